"""The ``kvoffload`` command: serve, status, tenant drop, demo, soak, bench."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from kvoffload.config import Config, ConfigError, load_config
from kvoffload.extras import MissingExtra
from kvoffload.logs import configure_logging
from kvoffload.runtime.discovery import NoServiceFound, find_endpoint
from kvoffload.runtime.runspec import EXIT_REFUSED
from kvoffload.wire.status import ManagerStatus, PeerWorkerStats, TenantStatus
from kvoffload.wire.tenant_ids import tenant_id

if TYPE_CHECKING:
    from kvoffload.client import KVOffloadClient

EXIT_PIPE_CLOSED = 128 + signal.SIGPIPE


def _load(args) -> Config:
    try:
        return load_config(args.config)
    except ConfigError as exc:
        print(f"kvoffload: invalid configuration: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_REFUSED) from None


def cmd_serve(args) -> int:
    from kvoffload.runtime.preflight import StartRefused
    from kvoffload.runtime.supervisor import Supervisor

    cfg = _load(args)
    configure_logging("supervisor", cfg.service.log_level)
    supervisor = Supervisor(cfg)
    try:
        supervisor.start()
    except StartRefused as exc:
        print(f"kvoffload: cannot start: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    code = supervisor.run_forever()
    if supervisor.failure is not None:
        print(f"kvoffload: stopped: {supervisor.failure}", file=sys.stderr)
    return code


def cmd_config_check(args) -> int:
    """Every check ``serve`` makes before it creates anything; the same refusal line."""
    from kvoffload.config import resolve_runtime_dir
    from kvoffload.runtime.preflight import StartRefused, check_startup

    cfg = _load(args)
    try:
        check_startup(cfg, resolve_runtime_dir(cfg))
    except StartRefused as exc:
        print(f"kvoffload: cannot start: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"kvoffload: configuration ok ({args.config or 'embedded defaults'})")
    return 0


def cmd_config_show(args) -> int:
    """The effective configuration (defaults, the file, the environment), secrets masked."""
    from kvoffload.config.toml import to_toml

    print(to_toml(_load(args).to_toml_dict(redact_secrets=True)), end="")
    return 0


def _service_client(args, name: str) -> tuple[str, KVOffloadClient]:
    """The endpoint of the running service (``--endpoint``, else discovery) and a client of
    it; SystemExit naming why when there is none."""
    from kvoffload.client import KVOffloadClient

    cfg = _load(args)
    try:
        endpoint = find_endpoint(args.endpoint, cfg)
    except NoServiceFound as exc:
        raise SystemExit(f"kvoffload: {exc}") from None
    return endpoint, KVOffloadClient(
        endpoint, timeout_s=5.0, name=name, curve_keys=_curve_keys(args)
    )


def cmd_status(args) -> int:
    endpoint, client = _service_client(args, "status")
    with client:
        status = client.status()
    if args.json:
        print(
            json.dumps(
                {"endpoint": endpoint, **msgspec.to_builtins(status)}, indent=2, sort_keys=True
            )
        )
    else:
        print(f"endpoint: {endpoint}")
        print(format_status(status))
    return 0


def cmd_tenant_drop(args) -> int:
    """Drop every block of one tenant; exit 1 when a tier could not remove all of them."""
    from kvoffload.client import KVOffloadError

    _, client = _service_client(args, "tenant-drop")
    with client:
        try:
            dropped = client.tenant_drop(args.name, timeout_s=args.timeout)
        except (KVOffloadError, TimeoutError, ValueError) as exc:
            raise SystemExit(f"kvoffload: tenant drop failed: {exc}") from None
    print(f"tenant {tenant_id(args.name)} dropped")
    for tier, removed in dropped.removed.items():
        failed = dropped.failed.get(tier, 0)
        note = "" if not failed else (" (removal failed)" if failed < 0 else f", {failed} failed")
        print(f"{tier:<10}{removed:>10} removed{note}")
    return 1 if dropped.failed else 0


def _curve_keys(args) -> tuple[bytes, bytes, bytes] | None:
    """(client public, client secret, server public) from ``--curve-secret`` and
    ``--curve-server-key``, for a tcp:// endpoint; None without them."""
    if not (args.curve_secret or args.curve_server_key):
        return None
    if not (args.curve_secret and args.curve_server_key):
        raise SystemExit("kvoffload: --curve-secret and --curve-server-key go together")
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(args.curve_secret)
        server, _ = zmq.auth.load_certificate(args.curve_server_key)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"kvoffload: cannot read the CURVE keys: {exc}") from None
    if secret is None:
        raise SystemExit(f"kvoffload: {args.curve_secret} holds no secret key")
    return public, secret, server


def cmd_keys_generate(args) -> int:
    from kvoffload.runtime.curvekeys import KeysExist, generate

    try:
        files = generate(Path(args.dir), args.client)
    except KeysExist as exc:
        print(f"kvoffload: {exc}", file=sys.stderr)
        return 2
    print(f"wrote CURVE keys under {Path(args.dir).resolve()} (mode 0600); use them with:\n")
    print(files.settings(args.endpoint), end="")
    return 0


def format_status(status: ManagerStatus) -> str:
    t = status.tiering
    lines = [
        f"uptime {status.uptime_s:.1f}s  clients {status.clients}  draining {status.draining}"
        + (f"  DEGRADED: {', '.join(status.tiers_down)} down" if status.tiers_down else ""),
        f"pool {status.pool.name}: {t.used_slots}/{t.slots} slots used, "
        f"{t.pinned_slots} pinned, {t.writing_slots} being written, "
        f"{t.unread_promotion_pins} unread promotions",
        f"jobs in flight: tier {t.jobs_in_flight}, device {status.device_jobs_in_flight}; "
        f"promotion amplification {t.promotion_amplification}",
        "",
        f"{'tier':<10}{'hit':>10}{'pending':>10}{'retry':>10}{'miss':>10}{'promoted':>10}"
        f"{'jobs':>8}{'failed':>8}{'evicted':>9}",
    ]
    if refused := status.client_handshakes_refused:
        by_reason = ", ".join(f"{reason} {n}" for reason, n in refused.items() if n)
        lines.insert(
            3,
            f"refused client handshakes: {sum(refused.values())}"
            + (f" ({by_reason})" if by_reason else ""),
        )
    for name, c in t.per_tier.items():
        jobs = c.promotion_jobs + c.cascade_jobs + c.probe_jobs
        failed = c.promotion_jobs_failed + c.cascade_jobs_failed + c.probe_jobs_failed
        lines.append(
            f"{name:<10}{c.lookups_hit:>10}{c.lookups_hit_pending:>10}{c.lookups_retry:>10}"
            f"{c.lookups_miss:>10}{c.promoted_keys_ok:>10}{jobs:>8}{failed:>8}{c.evictions:>9}"
        )
    lines.append("")
    lines.append(
        f"{'cascades':<10}{'ok':>10}{'waiting':>10}{'retried':>10}"
        f"{'dropped: evicted':>18}{'tier full':>11}{'retry bound':>13}{'dirty':>8}"
    )
    for name, tier in t.tiers.items():
        c = t.per_tier[name]
        if name == "peer":
            continue  # the peer tier stores nothing of this node's
        lines.append(
            f"{name:<10}{c.cascaded_keys_ok:>10}{tier.cascade_backlog:>10}"
            f"{c.cascade_keys_resubmitted:>10}{c.cascade_dropped_evicted:>18}"
            f"{c.cascade_dropped_tier_full:>11}{c.cascade_dropped_retry_bound:>13}"
            f"{tier.dirty_keys:>8}"
        )
    lines.append(
        f"write-back: {t.held_slots} slots held for their cascade; stores refused "
        f"{t.store_allocation_failures} ({t.stores_refused_dirty} for lack of clean room, "
        f"{t.store_backpressure_s:.1f}s refusing)"
    )
    lines.extend(format_tenants(t.tenants))
    lines.append("")
    lines.append(
        f"{'worker':<10}{'pid':>8}{'heartbeat':>11}{'inflight':>10}{'degraded':>10}{'restarts':>10}"
    )
    for name, w in status.workers.items():
        lines.append(
            f"{name:<10}{w.pid:>8}{w.last_heartbeat_s:>10.2f}s{w.inflight:>10}"
            f"{str(w.degraded):>10}{w.incarnation - 1:>10}"
        )
    peer = status.workers.get("peer")
    if peer is not None and isinstance(peer.stats.medium, PeerWorkerStats):
        lines.extend(format_peer(peer.stats.medium))
    return "\n".join(lines)


def format_peer(s: PeerWorkerStats) -> list[str]:
    """The peer row: the nodes followed, what they announce, the fetches made and served."""
    refused = sum(s.refused.values()) + sum(s.handshakes_refused.values())
    return [
        "",
        f"peer: {s.nodes_followed} nodes followed ({s.nodes_silent} silent, "
        f"{s.breakers_open} breakers open), {s.keys_indexed} keys indexed "
        f"({s.keys_not_indexed} left out)",
        f"  fetched {s.fetch_keys} keys ({s.fetch_bytes / 2**20:.1f} MiB) in {s.fetches} "
        f"fetches, {s.fetch_failures} failed, {s.fetch_bad_blocks} bad blocks dropped, "
        f"{s.fallbacks} keys fell through",
        f"  served {s.served_keys} keys ({s.served_bytes / 2**20:.1f} MiB) in "
        f"{s.served_fetches} fetches, {refused} refused",
    ]


def format_tenants(tenants: dict[str, TenantStatus]) -> list[str]:
    """One line per tenant (by id) and tier: blocks held, share, cap, evictions, refusals."""
    if not tenants:
        return []
    lines = [
        "",
        f"{'tenant':<18}{'hit':>8}{'pending':>9}{'miss':>8}  {'tier':<8}{'blocks':>8}"
        f"{'MiB':>9}{'share':>7}{'cap':>7}{'evicted':>9}{'by others':>10}{'refused':>9}",
    ]
    for tid, tenant in tenants.items():
        head = (
            f"{tid:<18}{tenant.lookups_hit:>8}{tenant.lookups_hit_pending:>9}"
            f"{tenant.lookups_miss:>8}"
        )
        for tier, c in tenant.tiers.items():
            cap = "-" if c.cap_blocks is None else str(c.cap_blocks)
            lines.append(
                f"{head:<43}  {tier:<8}{c.blocks:>8}{c.bytes / 2**20:>9.1f}{c.share_blocks:>7}"
                f"{cap:>7}{c.evictions:>9}{c.evicted_by_others:>10}{c.refused:>9}"
            )
            head = ""
    return lines


def cmd_demo(args) -> int:
    from kvoffload.engine.demo import run_demo

    cfg = _load(args)
    return run_demo(cfg, args)


def cmd_soak(args) -> int:
    from kvoffload.soak.runner import run_from_args

    configure_logging("soak", "error")
    return run_from_args(args)


def cmd_bench(args) -> int:
    from kvoffload.bench.runner import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvoffload", description="Tiered KV-cache offload service"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the service (supervisor, manager, workers)")
    serve.add_argument("--config", help="TOML config file (defaults are embedded)")
    serve.set_defaults(func=cmd_serve)

    status = sub.add_parser("status", help="print tiers, usage, hit rates and worker health")
    status.add_argument("--config", help="TOML config file of the running service")
    status.add_argument("--endpoint", help="client endpoint (default: find the live run)")
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    status.add_argument(
        "--curve-secret", help="this client's CURVE secret key file (a tcp:// endpoint)"
    )
    status.add_argument("--curve-server-key", help="the service's CURVE public key file")
    status.set_defaults(func=cmd_status)

    tenant = sub.add_parser("tenant", help="tenants of the running service")
    tenant_sub = tenant.add_subparsers(dest="tenant_command", required=True)
    drop = tenant_sub.add_parser(
        "drop", help="remove every block of a tenant from every tier and the shared bucket"
    )
    drop.add_argument("name", help="the tenant's name (vLLM's cache_salt, or an engine namespace)")
    drop.add_argument("--config", help="TOML config file of the running service")
    drop.add_argument("--endpoint", help="client endpoint (default: find the live run)")
    drop.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the tiers (default 60)"
    )
    drop.add_argument("--curve-secret", help="this client's CURVE secret key file")
    drop.add_argument("--curve-server-key", help="the service's CURVE public key file")
    drop.set_defaults(func=cmd_tenant_drop)

    config = sub.add_parser("config", help="check or show the configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser(
        "check", help="run serve's start-up checks without starting (exit 2: refused)"
    )
    check.add_argument("--config", help="TOML config file (defaults are embedded)")
    check.set_defaults(func=cmd_config_check)
    show_cmd = config_sub.add_parser(
        "show", help="print the effective configuration (file + environment), secrets masked"
    )
    show_cmd.add_argument("--config", help="TOML config file (defaults are embedded)")
    show_cmd.set_defaults(func=cmd_config_show)

    keys = sub.add_parser("keys", help="CURVE keys for a tcp:// client endpoint")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    generate = keys_sub.add_parser(
        "generate", help="write a server key pair and a client key pair, and print the settings"
    )
    generate.add_argument("dir", help="directory for the keys (made with mode 0700)")
    generate.add_argument("--client", default="client", help="the client key's name")
    generate.add_argument(
        "--endpoint", default="tcp://*:5555", help="the endpoint the printed settings name"
    )
    generate.set_defaults(func=cmd_keys_generate)

    demo = sub.add_parser(
        "demo",
        help="run the reference engine through the service and check reused KV changes nothing",
    )
    demo.add_argument(
        "--config",
        help="TOML config file (defaults are embedded; pool.block_bytes is set for the model)",
    )
    demo.add_argument("--conversations", type=int, default=4)
    demo.add_argument("--turns", type=int, default=4, help="turns of phase 1")
    demo.add_argument(
        "--blocks-per-turn", type=int, default=16, help="new user blocks (16 tokens each) per turn"
    )
    demo.add_argument("--new-tokens", type=int, default=8, help="tokens generated per turn")
    demo.add_argument("--seed", type=int, help="seed of the token ids (default: random, printed)")
    demo.add_argument(
        "--restart", action="store_true", help="also restart the whole service and serve from disk"
    )
    demo.add_argument("--json-out", help="write the rows and the verdict as JSON here")
    demo.set_defaults(func=cmd_demo)

    from kvoffload.soak.runner import add_arguments as add_soak_arguments

    soak = sub.add_parser(
        "soak", help="run the service under load and injected faults, check invariants"
    )
    add_soak_arguments(soak)
    soak.set_defaults(func=cmd_soak)

    from kvoffload.bench.runner import add_arguments as add_bench_arguments

    bench = sub.add_parser(
        "bench", help="run benchmark suites against their same-run references (JSON, charts)"
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command. A missing extra is one line and exit code 2; a closed output pipe ends
    the command quietly with 141 (128 + SIGPIPE), as a Unix tool killed by SIGPIPE reports."""
    try:
        args = build_parser().parse_args(argv)
        code = args.func(args)
        sys.stdout.flush()
        return code
    except MissingExtra as exc:
        print(f"kvoffload: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except BrokenPipeError:
        # Python would report the failed flush of stdout at exit: point it at /dev/null
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_PIPE_CLOSED


if __name__ == "__main__":
    sys.exit(main())
