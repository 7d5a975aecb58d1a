"""``kvtier``: inspect and manage the daemon's pool. ``main(argv) -> int``.

Commands: status, top (live, rates per second), clients, namespaces, flush.
Every command takes ``--socket`` and ``--json``. Exit codes: 0 ok, 1 the
daemon answered with an error (or refused the token), 3 no daemon running at
the socket.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .client import Client, DaemonUnavailable, KVTierError
from .console import print_or_pipe_closed
from .pool.sizes import format_size
from .protocol.endpoints import default_socket
from .top import run_top


CLI_NAME = "kvtier-cli"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier", description="Inspect and manage a kvtier daemon.")
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="pool, namespaces, clients, hit rate")
    fl = sub.add_parser("flush", help="drop cached prefix blocks (swap is kept)")
    fl.add_argument("--namespace", default="", help="only this namespace fingerprint")
    fl.add_argument("--wait", type=float, default=600.0,
                    help="seconds to wait for the flush to finish (the reply comes when every block is freed)")
    top = sub.add_parser("top", help="live view with rates per second (q or Ctrl-C quits)")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (0 = run until q)")
    cl = sub.add_parser("clients", help="connected clients")
    ns = sub.add_parser("namespaces", help="namespaces with blocks, bytes and hit counts")
    for sp in (st, fl, top, cl, ns):
        sp.add_argument("--socket", help="daemon socket (default: $KVTIER_SOCKET or the runtime dir)")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
        sp.add_argument("--token", default=None, help="shared secret, if the daemon has one "
                        "(default: $KVTIER_TOKEN)")
    from .demo.run import add_arguments  # no torch at import: the CLI stays light
    add_arguments(sub.add_parser("demo", help="two engines share a document's KV through kvtier "
                                 "(starts a private daemon unless --socket)"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo.run import run
        return run(args)
    socket = args.socket or default_socket()
    if not socket.startswith(("tcp://", "ipc://")) and not os.path.exists(socket):
        print(f"kvtier: no kvtier daemon is running at {socket} (no such socket). Start one with "
              "`kvtier-daemon`, or point --socket / KVTIER_SOCKET at it.", file=sys.stderr)
        return 3
    try:
        # top may idle longer than the reap timeout between refreshes: keep it alive
        client = Client(socket, name=CLI_NAME, timeout=args.timeout, token=args.token or "",
                        heartbeat=args.command == "top")
    except DaemonUnavailable:
        print(f"kvtier: no kvtier daemon answers at {socket} (the socket exists but nothing "
              f"replied within {args.timeout:g}s: a daemon that died, or is still starting).", file=sys.stderr)
        return 3
    except KVTierError as exc:  # HELLO refused: token, protocol version
        print(f"kvtier: {exc}", file=sys.stderr)
        return 1
    try:
        with client:
            if args.command == "top":
                return run_top(client, args.interval, args.iterations, args.json)
            return print_or_pipe_closed(run_command(client, args))
    except KVTierError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 1


def run_command(client: Client, args) -> str:
    if args.command == "flush":
        removed = client.flush(args.namespace or None, timeout=args.wait)
        return json.dumps({"removed": removed}) if args.json else f"removed {removed} blocks"
    stats = client.stats()
    # This CLI is a client too while it asks; it is not one of the engines being listed.
    stats["clients"] = [c for c in stats["clients"] if c["id"] != client.client_id]
    if args.command == "status":
        return json.dumps(stats, indent=2, sort_keys=True) if args.json else render_status(stats)
    rows = stats[args.command]
    render = render_clients if args.command == "clients" else render_namespaces
    return json.dumps(rows, indent=2, sort_keys=True) if args.json else render(rows)


def render_status(s: dict) -> str:
    p, t = s["pool"], s["totals"]
    lines = [
        f"kvtier-daemon pid {s['pid']}  up {s['uptime_s']:.0f}s  socket {s['socket']}",
        f"pool      {format_size(p['capacity_bytes'])} capacity, {format_size(p['used_bytes'])} used, "
        f"{format_size(p['free_bytes'])} free, {format_size(p['waste_bytes'])} waste, "
        f"{p['blocks']} blocks, {p['evictions']} evicted ({p['policy']}{_index(p)})" + _pinned(p) + _tail(p) + _faulting(p),
        *_sizes(p.get("sizes", [])),
        f"traffic   lookups {t['lookups']}  hits {t['hits']}  misses {t['misses']}  "
        f"hit rate {t['hit_rate']:.1%}  stores {t['stored']} blocks ({format_size(t['store_bytes'])})  "
        f"loads {t['loaded']} blocks ({format_size(t['load_bytes'])})",
        *_disk(s.get("disk", {})),
        *_remote(s.get("remote", {})),
        *_warm(s.get("warm_restart", {})),
        "", f"{'NAMESPACE':<48} {'BLOCK':>10} {'BLOCKS':>8} {'BYTES':>12} {'HITS':>8} {'MISSES':>8}",
    ]
    for n in s["namespaces"]:
        lines.append(f"{n['fingerprint'][:48]:<48} {format_size(n['block_bytes']):>10} {n['blocks']:>8} "
                     f"{format_size(n['bytes']):>12} {n['hits']:>8} {n['misses']:>8}")
    lines += ["", f"{'CLIENT':>6} {'PID':>8} {'NAME':<20} {'SWAP':>12} {'INFLIGHT':>8}  NAMESPACES"]
    for c in s["clients"]:
        lines.append(f"{c['id']:>6} {c['pid']:>8} {c['name'][:20]:<20} {format_size(c['swap_bytes']):>12} "
                     f"{c['inflight']:>8}  {', '.join(c['namespaces'])}")
    if s.get("errors"):
        lines += ["", "errors    " + "  ".join(f"{k} {v}" for k, v in sorted(s["errors"].items()))]
    return "\n".join(lines)


def render_clients(rows: list[dict]) -> str:
    lines = [f"{'ID':>5} {'PID':>8} {'NAME':<20} {'CONNECTED':>10} {'INFLIGHT':>8} {'SWAP':>12} "
             f"{'QUOTA':>12}  NAMESPACES"]
    for c in rows:
        quota = format_size(c["swap_quota"]) if c["swap_quota"] is not None else "-"  # null: no cap
        lines.append(f"{c['id']:>5} {c['pid']:>8} {c['name'][:20]:<20} {c['connected_s']:>9.0f}s "
                     f"{c['inflight']:>8} {format_size(c['swap_bytes']):>12} {quota:>12}  "
                     f"{', '.join(c['namespaces']) or '-'}")
    return "\n".join(lines)


def render_namespaces(rows: list[dict]) -> str:
    lines = [f"{'ID':>4} {'NAMESPACE':<48} {'BLOCK':>10} {'BLOCKS':>8} {'BYTES':>12} {'HITS':>9} "
             f"{'MISSES':>9} {'HIT%':>6} {'STORED':>9} {'LOADED':>9} {'EVICTED':>9}"]
    for n in rows:
        looked = n["hits"] + n["misses"]
        hit = f"{n['hits'] / looked:.0%}" if looked else "-"
        lines.append(f"{n['id']:>4} {n['fingerprint'][:48]:<48} {format_size(n['block_bytes']):>10} "
                     f"{n['blocks']:>8} {format_size(n['bytes']):>12} {n['hits']:>9} {n['misses']:>9} "
                     f"{hit:>6} {n['stored']:>9} {n['loaded']:>9} {n['evicted']:>9}")
    return "\n".join(lines)


def _index(p: dict) -> str:
    """Said only when the index runs in pure Python (no C compiler at install): ~300 B per block, not ~100."""
    return ", pure-Python index" if p.get("index") == "python" else ""


def _tail(p: dict) -> str:
    """The end of a pool that is not a multiple of the slab: mapped, never holding a block."""
    if not p.get("tail_bytes"):
        return ""
    return f"; {format_size(p['tail_bytes'])} of the {format_size(p['pool_bytes'])} pool is past the last slab (unused)"


def _faulting(p: dict) -> str:
    """A new pool serving while the rest of it faults in (prefault = background)."""
    if not p.get("faulting_bytes"):
        return ""
    return f"; {format_size(p['faulting_bytes'])} still faulting in (its slabs join as their pages are in)"


def _sizes(rows: list[dict]) -> list[str]:
    """Blocks each registered size holds and can hold (whole slabs of it)."""
    return [f"blocks    {format_size(r['block_bytes'])}: {r['blocks']} held, {r['free_blocks']} more fit, "
            f"{r['max_blocks']} at most ({r['per_slab']} per slab)" for r in rows]


def _disk(d: dict) -> list[str]:
    """The disk tier's line, on daemons that have one."""
    if not d.get("enabled"):
        return []
    failed = d["enospc"] + d["eio"] + d["errors"] + d["read_errors"]
    return [f"disk      {d['path']} {format_size(d['used_bytes'])} of {format_size(d['capacity_bytes'])}, "
            f"{d['blocks']} blocks{' (scanning)' if d['scanning'] else ''}  "
            f"written {d['written']} ({format_size(d['written_bytes'])})  read {d['read']} "
            f"({format_size(d['read_bytes'])})  dropped {d['dropped']}  rejected {d['rejected'] + d['scan_rejected']}  "
            f"timed out {d['timed_out']}  I/O errors {failed}"
            + (f" (ENOSPC {d['enospc']})" if d["enospc"] else "") + _writer(d.get("writer"))]


def _writer(w: dict | None) -> str:
    """Where the disk writes run, when that is news: a writer process that ended (its reason)."""
    if not w or w.get("process") or w.get("why", "").startswith(("disk_writer", "the writer process is starting")):
        return ""
    return f"  writes on the daemon's threads: {w['why']}"


def _remote(r: dict) -> list[str]:
    """The remote tier's line, on daemons that have one."""
    if not r.get("enabled"):
        return []
    state = "up" if r["state"] == "closed" else f"DOWN ({r['state']}: {r['last_error'] or 'no answer'})"
    return [f"remote    {r['endpoint']} {state}  hits {r['remote_hits']}  "
            f"fetched {r['fetched']} blocks ({format_size(r['fetched_bytes'])})  "
            f"written {r['written']} blocks ({format_size(r['written_bytes'])})  "
            f"corrupt {r['corrupt']}  forged {r.get('forged', 0)}  errors {r['errors']}  "
            f"queued {format_size(r['queued_bytes'])}  backlog {r.get('backlog_blocks', 0)} blocks"
            + _why_not(r.get("not_written", {}))]


def _why_not(rows: dict) -> str:
    """Blocks a tier did not write, by reason (every tenant's summed: {tenant: {why: n}} or {why: n})."""
    total: dict = {}
    for k, v in rows.items():
        for why, n in (v.items() if isinstance(v, dict) else [(k, v)]):
            total[why] = total.get(why, 0) + n
    if not total:
        return ""
    return f"  not written {sum(total.values())} (" + ", ".join(f"{w} {n}" for w, n in sorted(total.items())) + ")"


def _warm(w: dict) -> list[str]:
    """How this daemon started, on daemons with warm_restart on."""
    if not w.get("enabled"):
        return []
    if w["start"] == "warm":
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(w["adopted_at"]))
        head = (f"warm      adopted {w['adopted_blocks']} blocks at {when} in {w['adopt_s']:.3f}s "
                f"(refused {w['rejected_records']}, {w['unverified_blocks']} not yet verified, "
                f"{w['verify_failed']} failed verification)")
    else:
        head = f"warm      started cold: {w['reason']}"
    return [head + f"; keeping {w['kept_blocks']} blocks for the next daemon"
            + (f" ({w['not_kept']} not kept: journal full)" if w["not_kept"] else "")]


def _pinned(p: dict) -> str:
    """Pinning progress, shown only on daemons with a CUDA data path."""
    if not p.get("pinning") and not p.get("pinned_bytes"):
        return ""
    state = "pinning" if p.get("pinning") else "pinned"
    return f", {state} {format_size(p['pinned_bytes'])} of {format_size(p['capacity_bytes'])}"


if __name__ == "__main__":
    sys.exit(main())
