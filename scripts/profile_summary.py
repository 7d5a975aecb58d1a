"""Summarise ``py-spy record --format raw --threads`` files: where each process spent its CPU.

    python scripts/profile_summary.py DIR [--rate 100] [--top 12]

For every ``DIR/*.txt`` (one process each, as ``bench_vllm.py --profile DIR``
writes them): seconds sampled (CPU seconds; thread-seconds with idle threads
included for files named ``*-wall``, recorded with ``py-spy --idle``), per thread
name, and the share under kvtier's code, broken down by kvtier function (the
outermost kvtier frame of each stack, so a lookup and the socket work it does
count once, under the lookup; kvtier's own threads count by thread name). In a
``-wall`` file the rows under the engine's threads are time the engine spent in
kvtier calls, waits included: its critical path. Printed as Markdown.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?):?(?P<line>\d*)\)$")


def parse(path: str) -> list[tuple[str, list[str], int]]:
    """[(thread, [frames root first], samples)]; a frame reads ``file:function``."""
    out = []
    for line in open(path):
        line = line.rstrip("\n")
        if not line or " " not in line:
            continue
        stack, count = line.rsplit(" ", 1)
        parts = stack.split(";")
        thread, frames = parts[0], []
        for f in parts[1:]:
            m = _FRAME.match(f)
            frames.append(f"{_short(m['file'])}:{m['fn']}" if m else f)
        out.append((thread, frames, int(count)))
    return out


def _short(path: str) -> str:
    for root in ("kvtier/", "vllm/", "torch/", "zmq/", "transformers/"):
        if root in path:
            return root + path.split(root, 1)[1]
    return os.path.basename(path)


def summarise(path: str, rate: float, top: int) -> str:
    rows = parse(path)
    total = sum(n for _, _, n in rows)
    threads, kv = collections.Counter(), collections.Counter()
    for thread, frames, n in rows:
        name = re.sub(r"^thread \(\d+\):\s*", "", thread).strip() or thread
        threads[name] += n
        first = next((f for f in frames if f.startswith("kvtier/")), None)
        if first is not None:
            # kvtier's own threads (keeper, copy) by name; on the engine's threads, by function
            kv[f"thread {name}" if name.startswith("kvtier-") else first] += n
    kv_total = sum(kv.values())
    name = os.path.splitext(os.path.basename(path))[0]
    unit = "thread-s (idle included)" if name.endswith("-wall") else "CPU s"
    lines = [f"#### {name}: {total / rate:.2f} {unit} sampled, kvtier code {kv_total / rate:.2f} s "
             f"({100 * kv_total / max(total, 1):.1f}%)", "", f"| thread | {unit} |", "|---|---:|"]
    lines += [f"| {t} | {n / rate:.2f} |" for t, n in threads.most_common(top)]
    if kv:
        lines += ["", f"| kvtier function (outermost) | {unit} | share of process |", "|---|---:|---:|"]
        lines += [f"| `{f}` | {n / rate:.3f} | {100 * n / total:.2f}% |" for f, n in kv.most_common(top)]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--rate", type=float, default=100.0, help="py-spy's --rate (samples per second)")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    files = sorted(glob.glob(os.path.join(args.dir, "*.txt")))
    if not files:
        print(f"no py-spy files in {args.dir}", file=sys.stderr)
        return 1
    print("\n\n".join(summarise(f, args.rate, args.top) for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
