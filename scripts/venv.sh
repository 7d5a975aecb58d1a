# Sourced by scripts/demo.sh and scripts/test.sh.
#   need_python             Python >= 3.11 with venv support (apt installs python3.X-venv if missing)
#   apt_install PKG...      Debian packages (needs root)
#   make_venv DIR ARGS...   DIR: a virtual environment with CPU torch installed first (so pip
#                           never pulls a CUDA build), then `pip install ARGS`; then the
#                           caller's function `after_install DIR` if one is defined.
#                           `TORCH_VERSION=X make_venv ...` installs torch X instead (a
#                           release this machine holds a wheel of, or pip downloads it).
# Idempotent and quick on a second run: a stamp of what was asked for (and of
# pyproject.toml, setup.py and the C source it compiles) skips pip when nothing changed.

TORCH_VERSION=2.13.0

need_python() {
    PYTHON=${PYTHON:-python3}
    if ! command -v "$PYTHON" >/dev/null; then
        echo "kvtier needs Python >= 3.11 ($PYTHON not found; set PYTHON=...)" >&2; exit 1
    fi
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "kvtier needs Python >= 3.11 ($PYTHON is $("$PYTHON" -V 2>&1); set PYTHON=...)" >&2; exit 1
    fi
    # Debian and Ubuntu ship venv's pip bootstrap as its own package.
    if ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
        apt_install "python$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv"
    fi
}

apt_install() {
    if [ "$(id -u)" -ne 0 ]; then
        echo "installing $* needs root (apt-get): run as root, or install it first" >&2; exit 1
    fi
    echo "apt-get: installing $*" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

make_venv() {
    local dir=$1; shift
    local want
    want=$({ printf '%s\n' "$TORCH_VERSION" "$@"; cat pyproject.toml setup.py kvtier/pool/*.c; } | sha256sum | cut -c1-16)
    if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.kvtier-stamp" 2>/dev/null)" = "$want" ]; then
        return 0
    fi
    echo "setting up $dir: torch $TORCH_VERSION, then $*" >&2
    rm -f "$dir/.kvtier-stamp"
    [ -x "$dir/bin/python" ] || "$PYTHON" -m venv "$dir"
    "$dir/bin/python" -m pip install -q "torch==$TORCH_VERSION"
    "$dir/bin/python" -m pip install -q "$@"
    if declare -F after_install >/dev/null; then after_install "$dir"; fi
    echo "$want" > "$dir/.kvtier-stamp"
}
