"""Printing for command-line tools: a reader that went away is not an error."""

from __future__ import annotations

import os
import sys


def print_or_pipe_closed(text: str) -> int:
    """Print ``text``; when stdout's reader has exited (``| head``), stop quietly. Returns 0."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0
