"""Remote settings: URLs and seed lists parse, bad ones are refused naming the key."""

from __future__ import annotations

import pytest

from kvtier.daemon.config import DaemonConfig, load_config
from kvtier.remote.settings import RemoteSettings, parse_url


def test_a_seed_list_with_credentials_parses_and_displays_without_them():
    seeds, user, password = parse_url("redis://bob:s%40cret@10.0.0.1:7000,10.0.0.2:7001")
    assert seeds == [("10.0.0.1", 7000), ("10.0.0.2", 7001)] and (user, password) == ("bob", "s@cret")
    s = RemoteSettings("rediss://bob:x@h:1", password="explicit")
    assert s.tls and s.credentials == ("bob", "explicit") and s.display == "rediss://h:1"
    assert "Q" not in repr(RemoteSettings("redis://h:1", secret=b"Q" * 32, password="Q" * 9))


def test_the_daemon_config_refuses_credentials_where_engine_users_can_read_them(tmp_path):
    """kvtier.toml and the environment of the unit are readable by group kvtier."""
    with pytest.raises(ValueError, match="config remote: credentials in the URL"):
        DaemonConfig(remote="redis://bob:pw@h:1", remote_secret_file="/x")
    with pytest.raises(ValueError, match="config remote_password: moved to remote_secret_file"):
        load_config(env={"KVTIER_REMOTE": "redis://h:1", "KVTIER_REMOTE_PASSWORD": "pw"})
    # An older shipped kvtier.toml says remote_password = "": upgrading must not break it.
    old = tmp_path / "kvtier.toml"
    old.write_text('remote_password = ""\n')
    assert load_config(str(old), env={}).remote == ""
    old.write_text('remote_password = "pw"\n')
    with pytest.raises(ValueError, match="config remote_password: moved to remote_secret_file"):
        load_config(str(old), env={})
    with pytest.raises(ValueError, match="config remote_secret_file: the remote tier needs a secret file"):
        DaemonConfig(remote="redis://h:1", remote_secret_file="")


@pytest.mark.parametrize("url", ["http://h:1", "redis://h", "redis://h:99999", "redis://:1"])
def test_bad_remote_urls_are_refused_naming_the_key(url):
    with pytest.raises(ValueError, match="config remote:"):
        DaemonConfig(remote=url, remote_secret_file="/x")


def test_remote_keys_come_from_the_environment_with_sizes():
    cfg = load_config(env={"KVTIER_REMOTE": "redis://127.0.0.1:7000", "KVTIER_REMOTE_BUDGET": "2GiB",
                           "KVTIER_REMOTE_TTL_S": "60", "KVTIER_REMOTE_SECRET_FILE": "/etc/kvtier/remote.secret"})
    assert (cfg.remote, cfg.remote_budget, cfg.remote_ttl_s) == ("redis://127.0.0.1:7000", 2 * 2**30, 60.0)
    assert DaemonConfig().remote == ""  # off by default


def test_uid_numbers_are_not_tenant_names():
    """``uid<N>`` names a user listed nowhere, on this node only: an operator cannot give it
    to a tenant (it would merge with whichever user has that uid here, and cross nodes)."""
    with pytest.raises(ValueError, match="config tenants: 'uid1000': uid<N> is the name of a user listed nowhere"):
        DaemonConfig(tenants="uid1000:root")
    assert DaemonConfig(tenants="uidx:root; team-1:41001").tenants
