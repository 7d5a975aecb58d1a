#!/usr/bin/env python3
"""Two engines share a long document's KV blocks through kvtier (same as
``kvtier demo``; see kvtier/demo/run.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvtier.demo.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
