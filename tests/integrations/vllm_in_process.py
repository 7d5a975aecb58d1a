"""Several vLLM engines one after another in one process, for the tests.

    python tests/integrations/vllm_in_process.py PLAN.json

PLAN is a JSON list of ``client/vllm_offline.py engine`` argument lists; each
runs in this process (``--in-process`` is added: no engine-core or worker
process), printing its ``KVTIER_RESULT`` line in plan order. Starting vLLM's
two processes costs ~20 s per engine here, an in-process engine ~3 s. What
must be a new process (an engine loading another's prefix) goes in another plan.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(plan_file: str) -> int:
    spec = importlib.util.spec_from_file_location("vllm_offline", os.path.join(REPO, "client", "vllm_offline.py"))
    offline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(offline)
    for argv in json.load(open(plan_file)):
        rc = offline.main(["engine", "--in-process", *argv])
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
