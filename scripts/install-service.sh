#!/usr/bin/env bash
# Install kvtier-daemon as a systemd service on this node.
#
#   sudo scripts/install-service.sh [--daemon-bin PATH] [--enable] [--dry-run]
#
# Creates the system user and group `kvtier`, installs the unit to
# /etc/systemd/system, the config to /etc/kvtier/kvtier.toml (an existing
# config is kept; the new one lands beside it as kvtier.toml.new), a fresh
# remote-tier secret to /etc/kvtier/remote.secret (0600 kvtier:kvtier, kept
# if present; every node of a cluster needs the same one) and the
# operator guide to /usr/share/doc/kvtier, then runs `systemctl daemon-reload`.
#
# DESTDIR=/some/dir puts every file under that root (packaging, tests).
# --dry-run writes the files but only prints the commands that change the
# system (useradd, chown, systemctl), so it needs no root.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DESTDIR="${DESTDIR:-}"
DRY_RUN=0
ENABLE=0
DAEMON_BIN=""

usage() { sed -n '2,16s/^# \{0,1\}//p' "$0"; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --enable) ENABLE=1 ;;
    --daemon-bin) DAEMON_BIN="${2:?--daemon-bin needs a path}"; shift ;;
    --daemon-bin=*) DAEMON_BIN="${1#*=}" ;;
    -h|--help) usage 0 ;;
    *) echo "install-service.sh: unknown option $1" >&2; usage 2 ;;
  esac
  shift
done

# Commands that change the system go through here so --dry-run can show them.
run() {
  if [ "$DRY_RUN" = 1 ]; then
    echo "would run: $(printf '%q ' "$@")"
  else
    "$@"
  fi
}

if [ -z "$DAEMON_BIN" ]; then
  DAEMON_BIN="$(command -v kvtier-daemon || echo /usr/local/bin/kvtier-daemon)"
fi
case "$DAEMON_BIN" in
  /*) ;;
  *) echo "install-service.sh: --daemon-bin must be an absolute path" >&2; exit 2 ;;
esac
if [ ! -x "$DAEMON_BIN" ]; then
  echo "install-service.sh: warning: $DAEMON_BIN is not executable here (pip install kvtier first?)" >&2
fi

UNIT_DIR="$DESTDIR/etc/systemd/system"
CONF_DIR="$DESTDIR/etc/kvtier"
DOC_DIR="$DESTDIR/usr/share/doc/kvtier"

# 1. The service account: a system user whose group is the access list for the socket.
if ! getent group kvtier >/dev/null; then
  run groupadd --system kvtier
fi
if ! getent passwd kvtier >/dev/null; then
  run useradd --system --gid kvtier --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin --comment "kvtier KV-cache daemon" kvtier
fi

# 2. The unit, pointing at this node's kvtier-daemon.
install -d -m 0755 "$UNIT_DIR"
sed "s|^ExecStart=[^ ]*|ExecStart=$DAEMON_BIN|" "$HERE/daemon/kvtier-daemon.service" \
  > "$UNIT_DIR/kvtier-daemon.service.tmp"
chmod 0644 "$UNIT_DIR/kvtier-daemon.service.tmp"
mv "$UNIT_DIR/kvtier-daemon.service.tmp" "$UNIT_DIR/kvtier-daemon.service"
echo "installed $UNIT_DIR/kvtier-daemon.service (ExecStart=$DAEMON_BIN)"

# 3. The config: never overwrite an operator's edits. 0640 root:kvtier (may hold a token).
install -d -m 0750 "$CONF_DIR"
if [ -e "$CONF_DIR/kvtier.toml" ]; then
  install -m 0640 "$HERE/daemon/kvtier.toml" "$CONF_DIR/kvtier.toml.new"
  echo "kept $CONF_DIR/kvtier.toml; the shipped defaults are in kvtier.toml.new"
else
  install -m 0640 "$HERE/daemon/kvtier.toml" "$CONF_DIR/kvtier.toml"
  echo "installed $CONF_DIR/kvtier.toml"
fi
run chown root:kvtier "$CONF_DIR" "$CONF_DIR/kvtier.toml"

# 4. The remote tier's secret (MAC key, Redis password): the daemon's user alone reads it,
#    not group kvtier (engine users). Never overwritten: nodes of one cluster share it.
if [ -e "$CONF_DIR/remote.secret" ]; then
  echo "kept $CONF_DIR/remote.secret"
else
  ( umask 077
    { echo "# kvtier remote tier: the same file on every node of a cluster (copy it from the first)."
      echo "key = \"$(od -An -vtx1 -N32 /dev/urandom | tr -d ' \n')\""
      echo "# password = \"\"   # Redis AUTH / ACL password, if the cluster needs one"
      echo "# username = \"\"   # ACL user"
    } > "$CONF_DIR/remote.secret" )
  echo "installed $CONF_DIR/remote.secret (a new key: copy this file to every node that shares a cluster)"
fi
run chown kvtier:kvtier "$CONF_DIR/remote.secret"

# 5. The operator guide, referenced by the unit's Documentation=.
if [ -f "$HERE/README.md" ]; then
  install -d -m 0755 "$DOC_DIR"
  install -m 0644 "$HERE/README.md" "$DOC_DIR/README.md"
fi

# 6. Tell systemd.
run systemctl daemon-reload
if [ "$ENABLE" = 1 ]; then
  run systemctl enable --now kvtier-daemon.service
else
  echo "next: systemctl enable --now kvtier-daemon; add engine users with: usermod -aG kvtier USER"
fi
