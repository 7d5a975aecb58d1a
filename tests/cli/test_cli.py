"""The CLI's output matches what happened (main(argv) called directly)."""

from __future__ import annotations

import json

from kvtier.cli import main
from tests.helpers import NS, make_kv

OTHER = NS.fingerprint().replace("flashinfer", "mla")


def status_json(socket, capsys) -> dict:
    assert main(["status", "--json", "--socket", socket]) == 0
    return json.loads(capsys.readouterr().out)


def test_status_json_reflects_traffic(daemon, capsys):
    kv = make_kv(seed=1)
    hashes = [bytes([i]) * 16 for i in range(10)]
    with daemon.client(name="engine-x") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(hashes, list(range(10))).wait().ok
        assert c.store(hashes[:4], list(range(4))).wait().skipped == 4  # dedup
        assert c.lookup(hashes + [b"z" * 16]) == 10
        assert c.load(hashes[:6], list(range(6))).wait().ok
        s = status_json(daemon.socket, capsys)
        engine = [x for x in s["clients"] if x["name"] == "engine-x"]
        assert len(engine) == 1 and engine[0]["namespaces"] == [NS.fingerprint()]
    ns = s["namespaces"][0]
    assert ns["fingerprint"] == NS.fingerprint()
    assert (ns["blocks"], ns["bytes"], ns["block_bytes"]) == (10, 10 * 16384, 16384)
    assert (ns["stored"], ns["store_skipped"], ns["loaded"]) == (10, 4, 6)
    assert (ns["lookups"], ns["hits"], ns["misses"]) == (1, 10, 1)
    assert s["pool"]["used_bytes"] == 10 * 16384
    assert s["pool"]["used_bytes"] + s["pool"]["free_bytes"] + s["pool"]["waste_bytes"] == s["pool"]["capacity_bytes"]
    assert s["totals"]["store_bytes"] == 10 * 16384 and s["totals"]["load_bytes"] == 6 * 16384
    assert abs(s["totals"]["hit_rate"] - 10 / 11) < 1e-9
    kv.close()


def test_status_text_and_flush(daemon, capsys):
    kv, kv2 = make_kv(seed=2), make_kv(shape=(32, 16, 8))
    with daemon.client() as a, daemon.client() as b:
        a.register_kv_cache(kv, [0] * 4, NS)
        b.register_kv_cache(kv2, [0] * 4, OTHER)
        assert a.store([bytes([i]) * 16 for i in range(5)], list(range(5))).wait().ok
        assert b.store([bytes([i]) * 16 for i in range(3)], list(range(3))).wait().ok
    assert main(["status", "--socket", daemon.socket]) == 0
    text = capsys.readouterr().out
    assert NS.fingerprint() in text and OTHER in text and "hit rate" in text
    assert main(["flush", "--namespace", OTHER, "--socket", daemon.socket, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"removed": 3}
    s = status_json(daemon.socket, capsys)
    # OTHER is empty now; with no registration left the daemon may also forget it
    # on its next reaping pass, so it is either listed with 0 blocks or gone.
    held = {n["fingerprint"]: n["blocks"] for n in s["namespaces"]}
    assert held.pop(NS.fingerprint()) == 5 and held in ({}, {OTHER: 0})
    assert main(["flush", "--socket", daemon.socket]) == 0
    assert "removed 5 blocks" in capsys.readouterr().out
    assert main(["flush", "--namespace", "nope", "--socket", daemon.socket]) == 1
    assert "UNKNOWN_NAMESPACE" in capsys.readouterr().err
    kv.close()
    kv2.close()


def test_no_daemon_is_a_clear_error(tmp_path, capsys):
    assert main(["status", "--socket", str(tmp_path / "none.sock"), "--timeout", "0.3"]) == 3
    assert "no kvtier daemon" in capsys.readouterr().err


def test_refused_hello_is_exit_1_not_a_traceback(daemon_factory, capsys):
    # A daemon with a token refuses the CLI's HELLO (it sends none).
    d = daemon_factory(env={"KVTIER_TOKEN": "s3cret"})
    assert main(["status", "--socket", d.socket]) == 1
    assert "UNAUTHORIZED" in capsys.readouterr().err
