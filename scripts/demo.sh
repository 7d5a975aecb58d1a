#!/usr/bin/env bash
# The main job on a fresh machine: `kvtier demo` starts a private daemon and two
# engine processes that share a document's prefix, checks their tokens are
# identical with and without kvtier, and prints time-to-first-token for both.
# Sets up its own virtual environment (.venv: CPU torch, kvtier) on the first run.
# Needs Python >= 3.11 (PYTHON=... picks one); no GPU. Arguments go to `kvtier demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
need_python
make_venv .venv -e .
exec .venv/bin/kvtier demo "$@"
