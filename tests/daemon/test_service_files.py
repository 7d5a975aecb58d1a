"""The systemd unit and scripts/install-service.sh, installed into a temp root."""

from __future__ import annotations

import configparser
import os
import shutil
import stat
import subprocess

import pytest

from tests.conftest import REPO

UNIT = os.path.join(REPO, "daemon", "kvtier-daemon.service")
SCRIPT = os.path.join(REPO, "scripts", "install-service.sh")


def parse_unit(path) -> configparser.RawConfigParser:
    unit = configparser.RawConfigParser(strict=True, delimiters=("=",))
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read(path)
    return unit


def install(destdir, *args):
    return subprocess.run(["bash", SCRIPT, "--dry-run", *args], env={**os.environ, "DESTDIR": str(destdir)},
                          capture_output=True, text=True, timeout=60)


def test_unit_declares_the_service_contract():
    svc = parse_unit(UNIT)["Service"]
    assert svc["Type"] == "notify"
    assert svc["ExecStart"].split()[1:] == ["--config", "/etc/kvtier/kvtier.toml"]
    assert svc["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert (svc["User"], svc["Group"], svc["RuntimeDirectory"]) == ("kvtier", "kvtier", "kvtier")
    assert svc["RuntimeDirectoryMode"] == "0750"
    assert svc["LimitMEMLOCK"] == "infinity"
    assert svc["Restart"] == "on-failure" and svc["RestartPreventExitStatus"] == "2"
    # Drain (30 s in the daemon) must fit in the stop timeout.
    assert int(svc["TimeoutStopSec"]) > 30
    assert int(svc["WatchdogSec"]) > 0
    assert "PrivateDevices" not in svc  # GPUs and /dev/shm must stay visible


def test_install_into_destdir_dry_run(tmp_path):
    proc = install(tmp_path, "--daemon-bin", "/opt/kvtier/bin/kvtier-daemon")
    assert proc.returncode == 0, proc.stderr
    unit = tmp_path / "etc/systemd/system/kvtier-daemon.service"
    conf = tmp_path / "etc/kvtier/kvtier.toml"
    assert parse_unit(unit)["Service"]["ExecStart"] == \
        "/opt/kvtier/bin/kvtier-daemon --config /etc/kvtier/kvtier.toml"
    assert conf.read_text() == open(os.path.join(REPO, "daemon", "kvtier.toml")).read()
    assert stat.S_IMODE(conf.stat().st_mode) == 0o640          # may hold the token
    assert stat.S_IMODE(conf.parent.stat().st_mode) == 0o750
    assert (tmp_path / "usr/share/doc/kvtier/README.md").exists()
    # The remote tier's secret: the daemon's user alone, never the engines' group.
    secret = tmp_path / "etc/kvtier/remote.secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert "would run: chown kvtier:kvtier " + str(secret) in proc.stdout
    from kvtier.remote.secret import load_secret
    assert len(load_secret(str(secret)).key) == 32
    # System changes are only shown in a dry run.
    assert "would run: systemctl daemon-reload" in proc.stdout
    assert "would run: chown root:kvtier" in proc.stdout
    if subprocess.run(["getent", "group", "kvtier"], capture_output=True).returncode != 0:
        assert "would run: groupadd --system kvtier" in proc.stdout


def test_reinstall_keeps_the_operators_config(tmp_path):
    assert install(tmp_path).returncode == 0
    conf = tmp_path / "etc/kvtier/kvtier.toml"
    conf.write_text('pool_size = "64GiB"\n')
    proc = install(tmp_path)
    assert proc.returncode == 0
    assert conf.read_text() == 'pool_size = "64GiB"\n'
    assert (tmp_path / "etc/kvtier/kvtier.toml.new").exists()
    assert "kept" in proc.stdout
    # The secret is never replaced: every node of a cluster holds the same one.
    secret = tmp_path / "etc/kvtier/remote.secret"
    first = secret.read_text()
    assert install(tmp_path).returncode == 0 and secret.read_text() == first


def test_install_rejects_bad_arguments(tmp_path):
    assert install(tmp_path, "--bogus").returncode == 2
    assert install(tmp_path, "--daemon-bin", "relative/kvtier-daemon").returncode == 2


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_accepts_the_installed_unit(tmp_path):
    """systemd's own parser: unknown keys or bad values would be printed."""
    assert install(tmp_path, "--daemon-bin", shutil.which("true")).returncode == 0
    unit = tmp_path / "etc/systemd/system/kvtier-daemon.service"
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr
