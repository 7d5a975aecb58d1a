#!/usr/bin/env python3
"""Generate the wire golden vectors in ``protos/golden/`` (deterministic).

    python scripts/gen_golden.py            # rewrite protos/golden/*.json
    python scripts/gen_golden.py --check    # exit 1 if the committed files differ

Every value below is written by hand; the codec only produces the frame bytes.
For error vectors the expected code and request id are also written by hand and
checked against the codec here, so a regenerated file can never silently adopt
a codec change. JSON conventions: a ``bytes`` value is ``{"$hex": "..."}``;
frames are lowercase hex.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import msgpack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvtier.protocol import messages as m  # noqa: E402
from kvtier.protocol.arrays import pack_hashes, pack_ids, unpack_hashes, unpack_ids  # noqa: E402
from kvtier.protocol.codec import decode, encode  # noqa: E402
from kvtier.protocol.errors import ErrorCode, ProtocolError, side_of  # noqa: E402
from kvtier.protocol.hashing import DEFAULT_SEED, block_hashes  # noqa: E402

OUT_DIR = os.path.join(ROOT, "protos", "golden")
FP = "tiny-llama|float16|flashinfer|bs16|tp0of1"
TOKENS = list(range(1000, 1048))          # three full blocks of 16 tokens
HASHES = block_hashes(TOKENS, 16)
SPEC = {"kind": "fd", "fd": 0, "offset": 0, "dtype": "float16",
        "shape": [32, 2, 16, 2, 32], "stride": [2048, 1024, 64, 32, 1], "block_dim": 0}
U64_MAX = (1 << 64) - 1
DIRECTION = {cls.TAG: "reply" for cls in (m.Welcome, m.Registered, m.Hits, m.HitsMany, m.TransferDone,
                                          m.StatsReply, m.Flushed, m.Ok, m.Error)}
RESERVED: set[str] = set()  # tags in the codec that the daemon does not serve yet


def stats_document() -> dict:
    """A stats reply as kvtier/daemon/stats.py builds it (fixed values)."""
    ns_counts = {"lookups": 4, "hits": 6, "misses": 2, "stored": 3, "store_skipped": 3,
                 "store_failed": 0, "loaded": 3, "load_failed": 0, "evicted": 0}
    ns = {"id": 1, "fingerprint": FP, "block_bytes": 16384, "blocks": 3, "bytes": 49152,
          "writing": 0, **ns_counts}
    totals = {**ns_counts, "hit_rate": 0.75, "store_bytes": 49152, "load_bytes": 49152,
              "stores": 2, "loads": 1, "offload_bytes": 0, "restore_bytes": 0,
              "requests": 12, "reaped": 0, "cancelled": 0}
    client = {"id": 1, "pid": 4242, "name": "engine-a", "connected_s": 1.5,
              "namespaces": [FP], "inflight": 0, "swap_bytes": 0, "swap_quota": 0,
              "swap_requests": 0}
    pool = {"capacity_bytes": 67108864, "used_bytes": 49152, "free_bytes": 67059712,
            "waste_bytes": 0, "slab_bytes": 4194304, "slabs": 1, "free_slabs": 15,
            "blocks": 3, "evictions": 0, "policy": "lru"}
    return {"version": 1, "pid": 4000, "uptime_s": 12.5, "socket": "/run/kvtier/kvtier.sock",
            "pool": pool, "namespaces": [ns], "clients": [client], "totals": totals,
            "errors": {"BAD_ARGUMENT": 1}}


def messages() -> list[tuple[str, object, int]]:
    """(name, message, request_id): at least one per class, boundary ids included."""
    h = pack_hashes(HASHES)
    return [
        ("hello", m.Hello(1, 4242, "engine-a", ""), 1),
        ("hello_defaults", m.Hello(1, 0), 2),
        ("hello_token", m.Hello(1, 4242, "engine-b", "s3cret"), 3),
        ("register", m.Register(FP, [SPEC], 1, -1), 4),
        ("register_factor", m.Register(FP, [SPEC, {**SPEC, "offset": 131072}], 4, 1 << 30,
                                       "5f0e1d2c3b4a69788796a5b4c3d2e1f0"), 5),
        ("unregister", m.Unregister(1), 6),
        ("lookup", m.Lookup(1, h), 7),
        ("lookup_empty", m.Lookup(1, b""), 8),
        ("store", m.Store(1, h, pack_ids([3, 4, 5])), 9),
        ("load", m.Load(1, h, pack_ids([20, 21, 22]), 0), 10),
        ("load_skip", m.Load(2, h[:32], pack_ids([7, 8, 9, 10, 11, 12, 13]), 1), 11),
        ("offload", m.Offload(1, [["req-1", pack_ids([1, 2])], ["req-2", pack_ids([9])]]), 12),
        ("restore", m.Restore(1, "req-1", pack_ids([30, 31])), 13),
        ("discard", m.Discard(1, "req-2"), 14),
        ("stats", m.Stats(), 15),
        ("flush_all", m.Flush(), 16),
        ("flush_namespace", m.Flush(FP), 17),
        ("ping", m.Ping(), 0),
        ("ping_max_id", m.Ping(), U64_MAX),
        ("bye", m.Bye(), 255),
        ("cancel", m.Cancel(12), 18),
        ("lookups_answered", m.LookupsAnswered([[1, 3, 96, 64]]), 21),
        ("lookup_many", m.LookupMany(1, [pack_hashes(HASHES), pack_hashes(HASHES[:1])]), 19),
        ("load_prefix", m.Load(1, pack_hashes(HASHES), pack_ids([20, 21, 22]), 0, b"", True), 20),
        ("hits_many", m.HitsMany(pack_ids([3, 1])), 19),
        ("welcome", m.Welcome(1, 1, 2.0, 16777216, 4000), 1),
        ("welcome_without_daemon_pid", m.Welcome(1, 1, 2.0, 16777216), 1),
        ("registered", m.Registered(1, 1, 16384, 32), 4),
        ("registered_with_index", m.Registered(1, 1, 16384, 32, "/kvtier-ix.4000.0123456789abcdef"), 4),
        ("hits", m.Hits(2), 7),
        ("done_store", m.TransferDone(2, 1, b"", False), 9),
        ("done_store_no_space", m.TransferDone(1, 0, pack_ids([1, 2]), True), 9),
        ("done_load_failed", m.TransferDone(2, 0, pack_ids([2])), 10),
        ("error_cancelled", m.Error(12, "store cancelled (cancelled by the client)", "daemon"), 12),
        ("stats_reply", m.StatsReply(stats_document()), 15),
        ("flushed", m.Flushed(3), 16),
        ("ok", m.Ok(), 6),
        ("error", m.Error(5, "cache 9 is not registered by this client", "client"), 65536),
        ("error_daemon", m.Error(6, "RuntimeError: boom", "daemon"), 1 << 32),
    ]


def lenient() -> list[tuple[str, bytes, object, int]]:
    """Frames that decode although no encoder writes them (name, frame, message, id)."""
    pk = lambda obj: msgpack.packb(obj, use_bin_type=True)  # noqa: E731
    return [
        ("defaults_omitted", pk(["hi", 5, {"version": 1, "pid": 7}]), m.Hello(1, 7), 5),
        ("unknown_key_ignored", pk(["ping", 6, {"future": [1, 2]}]), m.Ping(), 6),
        ("int_for_float", pk(["welcome", 7, {"version": 1, "client_id": 2, "heartbeat_s": 2,
                                             "max_message": 1024}]), m.Welcome(1, 2, 2.0, 1024), 7),
        ("key_order_free", pk(["lk", 8, {"hashes": b"", "reg": 3}]), m.Lookup(3, b""), 8),
        ("float32_for_float", msgpack.packb(["welcome", 9, {"version": 1, "client_id": 2,
                                                            "heartbeat_s": 0.5, "max_message": 64}],
                                            use_single_float=True), m.Welcome(1, 2, 0.5, 64), 9),
    ]


def errors() -> list[dict]:
    """Bad frames with the code and request id the decoder must report."""
    pk = lambda obj: msgpack.packb(obj, use_bin_type=True)  # noqa: E731
    bm, uo, ba, tl = (ErrorCode.BAD_MESSAGE, ErrorCode.UNKNOWN_OP, ErrorCode.BAD_ARGUMENT,
                      ErrorCode.TOO_LARGE)
    v = lambda name, frame, code, rid, **kw: {"name": name, "frame": frame, "code": code,  # noqa: E731
                                             "request_id": rid, **kw}
    return [
        v("not_msgpack", b"\xc1", bm, 0),
        v("truncated", pk(["ping", 1, {}])[:-1], bm, 0),
        v("trailing_bytes", pk(["ping", 1, {}]) + b"\x00", bm, 0),
        v("empty_frame", b"", bm, 0),
        v("not_an_array", pk({"tag": "ping"}), bm, 0),
        v("arity_2", pk(["ping", 1]), bm, 0),
        v("arity_4", pk(["ping", 1, {}, None]), bm, 0),
        v("request_id_negative", pk(["ping", -1, {}]), bm, 0),
        v("request_id_float", pk(["ping", 1.0, {}]), bm, 0),
        v("request_id_bool", pk(["ping", True, {}]), bm, 0),
        v("request_id_str", pk(["ping", "1", {}]), bm, 0),
        v("non_string_map_key", pk(["ping", 3, {1: 2}]), bm, 0),
        v("invalid_utf8", b"\x93\xa4pin\xff\x03\x80", bm, 0),
        v("oversize", pk(["flush", 9, {"namespace": "x" * 64}]), tl, 0, max_bytes=64),
        v("tag_not_string", pk([7, 10, {}]), bm, 10),
        v("tag_is_bin", pk([b"ping", 11, {}]), bm, 11),
        v("unknown_tag", pk(["nope", 12, {}]), uo, 12),
        v("body_not_map", pk(["ping", 13, []]), bm, 13),
        v("missing_field", pk(["lk", 14, {"reg": 1}]), bm, 14),
        v("str_for_bytes", pk(["lk", 15, {"reg": 1, "hashes": "00" * 16}]), bm, 15),
        v("bytes_for_str", pk(["flush", 16, {"namespace": b"abc"}]), bm, 16),
        v("float_for_int", pk(["unreg", 17, {"reg": 1.0}]), bm, 17),
        v("bool_for_int", pk(["unreg", 18, {"reg": True}]), bm, 18),
        v("bool_for_float", pk(["welcome", 19, {"version": 1, "client_id": 1, "heartbeat_s": False,
                                                "max_message": 1}]), bm, 19),
        v("nil_for_int", pk(["hits", 20, {"hits": None}]), bm, 20),
        v("list_for_dict", pk(["stats", 21, {"stats": []}]), bm, 21),
        v("hashes_not_multiple_of_16", pk(["lk", 22, {"reg": 1, "hashes": bytes(15)}]), ba, 22,
          stage="unpack_hashes", field="hashes"),
        v("blocks_not_multiple_of_4", pk(["st", 23, {"reg": 1, "hashes": bytes(16), "blocks": bytes(6)}]),
          ba, 23, stage="unpack_ids", field="blocks"),
    ]


# ---- JSON ---------------------------------------------------------------------------------

def to_json(value):
    if isinstance(value, bytes):
        return {"$hex": value.hex()}
    if isinstance(value, dict):
        return {k: to_json(x) for k, x in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(x) for x in value]
    return value


def fields_of(msg) -> dict:
    return to_json(m.as_wire_dict(msg))


def check_error(vec: dict) -> ErrorCode:
    """Run the vector through the stage it names; fail unless it raises the
    vector's code and the error reply would carry the vector's request id."""
    try:
        rid, msg = decode(vec["frame"], vec.get("max_bytes", m.MAX_MESSAGE_BYTES))
    except ProtocolError as exc:
        code, rid = exc.code, exc.request_id
    else:  # decoded: the array check fails later, under the decoded id
        unpack = {"unpack_hashes": unpack_hashes, "unpack_ids": unpack_ids}[vec.get("stage")]
        try:
            unpack(getattr(msg, vec["field"]))
        except ProtocolError as exc:
            code = exc.code
        else:
            raise SystemExit(f"{vec['name']}: the codec accepted a bad frame")
    if (code, rid) != (vec["code"], vec["request_id"]):
        raise SystemExit(f"{vec['name']}: codec says {code!r} id {rid}, "
                         f"vector says {vec['code']!r} id {vec['request_id']}")
    return code


def schema() -> dict:
    rows = []
    for tag, cls in m.TABLE.items():
        fields = []
        for f in m.wire_fields(cls):
            row = {"name": f.name, "type": f.type}
            if f.default is not m.dataclasses.MISSING:
                row["default"] = to_json(f.default)
            fields.append(row)
        rows.append({"tag": tag, "class": cls.__name__,
                     "direction": DIRECTION.get(tag, "request"),
                     "reserved": tag in RESERVED, "fields": fields})
    return {"protocol_version": m.PROTOCOL_VERSION, "max_message_bytes": m.MAX_MESSAGE_BYTES,
            "error_codes": [{"code": int(c), "name": c.name, "side": side_of(c)} for c in ErrorCode],
            "messages": rows}


def build() -> dict[str, object]:
    """File name -> JSON document."""
    pos = [{"name": n, "tag": msg.TAG, "class": type(msg).__name__, "request_id": rid,
            "fields": fields_of(msg), "frame": encode(msg, rid).hex()} for n, msg, rid in messages()]
    len_ = [{"name": n, "tag": msg.TAG, "request_id": rid, "fields": fields_of(msg), "frame": f.hex(),
             "canonical": encode(msg, rid).hex()} for n, f, msg, rid in lenient()]
    for n, f, msg, rid in lenient():
        if decode(f) != (rid, msg):
            raise SystemExit(f"lenient vector {n} does not decode as written")
    neg = []
    for vec in errors():
        code = check_error(vec)
        neg.append({"name": vec.pop("name"), "stage": vec.pop("stage", "decode"), **vec,
                    "frame": vec["frame"].hex(), "code": int(code), "code_name": code.name,
                    "side": side_of(code)})
    return {"schema.json": schema(), "messages.json": pos, "lenient.json": len_,
            "errors.json": neg, "hashing.json": hashing(), "events.json": events()}


def hashing() -> list[dict]:
    cases = [("three_blocks", TOKENS, 16, DEFAULT_SEED, b""),
             ("partial_tail_dropped", TOKENS + [1, 2, 3], 16, DEFAULT_SEED, b""),
             ("with_extra", TOKENS, 16, DEFAULT_SEED, b"lora:7"),
             ("other_seed", TOKENS, 16, b"my-deployment", b""),
             ("negative_and_large_tokens", [-1, 0, 2**40, -(2**63), 2**63 - 1, 5, 6, 7], 4,
              DEFAULT_SEED, b""),
             ("shorter_than_a_block", [1, 2, 3], 16, DEFAULT_SEED, b"")]
    return [{"name": n, "tokens": t, "block_size": bs, "seed": {"$hex": seed.hex()},
             "extra": {"$hex": extra.hex()},
             "hashes": [x.hex() for x in block_hashes(t, bs, seed=seed, extra=extra)]}
            for n, t, bs, seed, extra in cases]


def events() -> list[dict]:
    """PUB event messages as the daemon's _publish_events builds them."""
    body = {"seq": 1, "ts": 1700000000.25,
            "events": [["stored", HASHES[0]], ["stored", HASHES[1]], ["removed", HASHES[0]]]}
    return [{"name": "stored_and_removed", "topic": FP.encode().hex(), "fields": to_json(body),
             "body": msgpack.packb(body, use_bin_type=True).hex()}]


def render(doc) -> str:
    """A list of vectors is written one vector per line (reviewable diffs)."""
    if isinstance(doc, list):
        return "[\n" + ",\n".join(json.dumps(v) for v in doc) + "\n]\n"
    return json.dumps(doc, indent=1) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args(argv)
    stale = []
    os.makedirs(OUT_DIR, exist_ok=True)
    for name, doc in build().items():
        path, text = os.path.join(OUT_DIR, name), render(doc)
        old = open(path).read() if os.path.exists(path) else None
        if old != text:
            stale.append(name)
            if not args.check:
                with open(path, "w") as f:
                    f.write(text)
    if args.check and stale:
        print("stale golden files: " + ", ".join(stale), file=sys.stderr)
        return 1
    print("wrote " + ", ".join(stale) if stale and not args.check else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
