"""Config precedence (defaults < file < KVTIER_* env < flags), validation, and
the shipped daemon/kvtier.toml, all through ``kvtier-daemon --print-config``."""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib

import pytest

from kvtier.daemon.config import DaemonConfig, load_config
from kvtier.daemon.main import main
from tests.conftest import REPO

SHIPPED = os.path.join(REPO, "daemon", "kvtier.toml")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)


def effective(capsys, *argv) -> dict:
    assert main(["--print-config", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_each_level_overrides_the_previous(tmp_path, monkeypatch, capsys):
    conf = tmp_path / "kvtier.toml"
    conf.write_text('pool_size = "1GiB"\npolicy = "fifo"\nheartbeat_s = 3.0\nlog_level = "DEBUG"\n')
    monkeypatch.setenv("KVTIER_POLICY", "lru")            # env beats file
    monkeypatch.setenv("KVTIER_HEARTBEAT_S", "4.5")       # env beats file
    monkeypatch.setenv("KVTIER_LOG_LEVEL", "WARNING")     # ...but a flag beats env
    cfg = effective(capsys, "--config", str(conf), "--log-level", "ERROR", "--metrics", "127.0.0.1:9464")
    defaults = DaemonConfig()
    assert cfg["slab_size"] == defaults.slab_size          # default: nobody set it
    assert cfg["pool_size"] == 2**30                       # file over default
    assert (cfg["policy"], cfg["heartbeat_s"]) == ("lru", 4.5)  # env over file
    assert cfg["log_level"] == "ERROR"                     # flag over env
    assert cfg["metrics"] == "127.0.0.1:9464"              # flag over default

    # The same through the library entry point, with an explicit env dict.
    c = load_config(str(conf), env={"KVTIER_POOL_SIZE": "512MiB"}, flags={"pool_size": "256MiB"})
    assert c.pool_size == 256 * 2**20
    c = load_config(str(conf), env={"KVTIER_POOL_SIZE": "512MiB"})
    assert c.pool_size == 512 * 2**20


def test_kvtier_config_names_the_file_and_a_flag_still_wins(tmp_path):
    # An operator running the daemon by hand, or a test suite on a node where the
    # service is installed, points at another file than /etc/kvtier/kvtier.toml.
    by_env = tmp_path / "env.toml"
    by_env.write_text('policy = "fifo"\n')
    by_flag = tmp_path / "flag.toml"
    by_flag.write_text('policy = "lru"\n')
    assert load_config(env={"KVTIER_CONFIG": str(by_env)}).policy == "fifo"
    assert load_config(str(by_flag), env={"KVTIER_CONFIG": str(by_env)}).policy == "lru"
    with pytest.raises(ValueError, match="missing.toml"):
        load_config(env={"KVTIER_CONFIG": str(tmp_path / "missing.toml")})


@pytest.mark.parametrize("file_text, env, argv, key", [
    ('policy = "mru"\n', {}, [], "policy"),
    ('pool = "1GiB"\n', {}, [], "'pool'"),                          # unknown key is named
    ("", {"KVTIER_POOL_SIZE": "lots"}, [], "pool_size"),
    ("", {"KVTIER_RAM_FRACTION": "1.5"}, [], "ram_fraction"),
    ("heartbeat_s = 5.0\nreap_after_s = 4.0\n", {}, [], "reap_after_s"),
    ("", {}, ["--metrics", "9464"], "metrics"),
    ("", {}, ["--log-format", "xml"], "log_format"),
    ("", {}, ["--slab-size", "1000"], "slab_size"),
    ("socket_mode = 0o1777\n", {}, [], "socket_mode"),
    ("", {"KVTIER_REAP_INTERVAL_S": "inf"}, [], "reap_interval_s"),   # the poll timeout: crashed the loop
    ("reap_interval_s = 1e300\n", {}, [], "reap_interval_s"),
    ("heartbeat_s = nan\n", {}, [], "heartbeat_s"),
    ("", {"KVTIER_TENANT_SHARE": "0"}, [], "tenant_share"),            # 0 would refuse every store
    ("tenant_share = nan\n", {}, [], "tenant_share"),
    ("tenant_share = 1.01\n", {}, [], "tenant_share"),
    ('prefault = "lazy"\n', {}, [], "prefault"),
])
def test_invalid_values_exit_2_naming_the_key(tmp_path, monkeypatch, capsys, file_text, env, argv, key):
    conf = tmp_path / "kvtier.toml"
    conf.write_text(file_text)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["--config", str(conf), "--print-config", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier-daemon: ") and key in err, err


def test_unreadable_toml_exits_2(tmp_path, capsys):
    conf = tmp_path / "kvtier.toml"
    conf.write_text("pool_size = \n")
    assert main(["--config", str(conf), "--print-config"]) == 2
    assert str(conf) in capsys.readouterr().err


def test_deeply_nested_toml_is_a_config_error(tmp_path, capsys):
    # tomllib raises RecursionError here, which escaped both startup (a
    # traceback, exit 1) and a SIGHUP reload (the poll loop died).
    conf = tmp_path / "kvtier.toml"
    conf.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    assert main(["--config", str(conf), "--print-config"]) == 2
    assert "nested too deeply" in capsys.readouterr().err


PER_MACHINE = {"copy_threads"}  # defaults computed at start: the shipped file names them in a comment only


def test_shipped_config_has_every_key_with_default_values(capsys):
    with open(SHIPPED, "rb") as f:
        raw = tomllib.load(f)
    fields = [f.name for f in dataclasses.fields(DaemonConfig)]
    assert sorted(raw) == sorted(set(fields) - PER_MACHINE)
    text = open(SHIPPED).read().splitlines()
    assert all(f"# {key} = " in "\n".join(text) for key in PER_MACHINE)
    # It loads, and apart from the service's socket it states the real defaults,
    # as its header promises.
    cfg = effective(capsys, "--config", SHIPPED)
    defaults = DaemonConfig(socket="/run/kvtier/kvtier.sock").as_dict()
    assert cfg == defaults


def test_every_key_is_documented_in_the_shipped_config():
    lines = open(SHIPPED).read().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), f"{line!r} has no comment above it"
