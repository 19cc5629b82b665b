"""The soak's invariants: what the engines report, what the service shows at quiescence, and
what a run leaves behind; each broken one is a ``Violation``.

- engines: every ``violation`` event (wrong bytes, duplicate or foreign job result, unexpected
  error code, call overrun) is one; a ``timeout``, ``job_lost`` or ``lookup_stuck`` event is
  excused only when its interval overlaps a fault window (a manager restart), else it is one;
- quiescence: pinned, writing, in-flight and waiting-cascade counts all zero, every worker
  connected with its index announced, no client session left, no client KV cache still mapped
  by the cpu worker;
- durability: every acknowledged block comes back after ``reset_cache``, unless the service
  logged it as given up (``cascade_dropped``: evicted first, tier full, retry bound) or as lost
  by a tier (evicted by the disk tier, or a corrupt copy removed). A block given up for the
  disk tier as ``evicted`` (it left the pool before reaching the disk) is a loss, never an
  excuse: the disk tier holds every block until its cascade landed, so with a disk that had
  room only a cache reset with the disk offline may drop one;
- manager RSS: the peak stays under a limit;
- leftovers: no shared-memory segment, runtime file or process of the run after shutdown.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXCUSABLE_EVENTS = {
    "timeout": "timeout_outside_fault_window",
    "job_lost": "job_without_result",
    "lookup_stuck": "lookup_stuck",
}
QUIESCENT_ZERO = ("pinned_slots", "writing_slots", "jobs_in_flight", "cascade_backlog")
LOSS_EVENTS = {
    "cascade_dropped": "cascade_dropped",
    "disk_keys_evicted": "disk_evicted",
    "disk_block_corrupt": "disk_corrupt",
    "disk_scan_corrupt_blocks": "disk_corrupt",
    "object_block_corrupt_deleted": "object_corrupt",
    "object_corrupt_delete_failed": "object_corrupt",
}
"""Log events of the service that name keys a tier legitimately lost (or never got), and the
excuse each gives."""
WINDOW_SLACK_S = 1.0


@dataclass
class Violation:
    kind: str
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.detail}


class ReportReader:
    """Reads the engines' JSON-lines reports incrementally; a partial last line (a killed
    writer) waits for the next read or is dropped."""

    def __init__(self) -> None:
        self._offsets: dict[Path, int] = {}
        self.latest_stats: dict[Path, dict[str, int]] = {}
        self.events: list[dict[str, Any]] = []

    def read(self, paths: list[Path]) -> None:
        for path in paths:
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(path, 0))
                    chunk = f.read()
            except FileNotFoundError:
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("ev") == "stats":
                    self.latest_stats[path] = {
                        k: v for k, v in record.items() if k not in ("ev", "t")
                    }
                elif record.get("ev") != "exit":
                    self.events.append(record)

    def totals(self) -> Counter:
        total: Counter = Counter()
        for stats in self.latest_stats.values():
            total.update(stats)
        return total


def _overlaps(t0: float, t1: float, windows: list[tuple[float, float]]) -> bool:
    return any(
        t0 <= end + WINDOW_SLACK_S and start - WINDOW_SLACK_S <= t1 for start, end in windows
    )


def judge_engine_events(
    events: list[dict], windows: list[tuple[float, float]]
) -> tuple[Counter, list[Violation]]:
    """(excused events by kind, violations) for the engines' events."""
    excused: Counter = Counter()
    violations: list[Violation] = []
    for event in events:
        kind = event.get("ev")
        if kind == "violation":
            detail = {k: v for k, v in event.items() if k not in ("ev", "kind")}
            violations.append(Violation(event.get("kind", "unknown"), detail))
        elif kind in EXCUSABLE_EVENTS:
            if _overlaps(event.get("t0", 0.0), event.get("t1", 0.0), windows):
                excused[kind] += 1
            else:
                violations.append(
                    Violation(EXCUSABLE_EVENTS[kind], {k: v for k, v in event.items() if k != "ev"})
                )
    return excused, violations


def is_quiescent(status: dict) -> bool:
    tiering = status["tiering"]
    return (
        all(tiering[name] == 0 for name in QUIESCENT_ZERO) and status["device_jobs_in_flight"] == 0
    )


def check_quiescent(status: dict | None) -> list[Violation]:
    if status is None:
        return [Violation("manager_unreachable_at_quiescence")]
    tiering = status["tiering"]
    found = {name: tiering[name] for name in QUIESCENT_ZERO if tiering[name]}
    if status["device_jobs_in_flight"]:
        found["device_jobs_in_flight"] = status["device_jobs_in_flight"]
    return [Violation("not_quiescent", found)] if found else []


def check_workers_up(status: dict | None, names: list[str]) -> list[Violation]:
    workers = (status or {}).get("workers", {})
    missing = [n for n in names if n not in workers or not workers[n]["index_complete"]]
    return [Violation("workers_down_at_end", {"missing": missing})] if missing else []


def check_sessions_gone(status: dict | None) -> list[Violation]:
    """After every engine left, only the observer's own session may remain."""
    clients = (status or {}).get("clients", 0)
    return [Violation("client_sessions_left", {"clients": clients})] if clients > 1 else []


def check_client_mappings(segments: list[str]) -> list[Violation]:
    """No KV cache segment of a departed client may stay mapped by the cpu worker."""
    return [Violation("client_kv_still_mapped", {"segments": segments})] if segments else []


def is_disk_eviction(event: dict) -> bool:
    """A block given up for the disk tier because it left the pool first (a loss, not an
    excuse: see the module docstring)."""
    return (
        event.get("event") == "cascade_dropped"
        and event.get("tier") == "disk"
        and event.get("reason") == "evicted"
    )


def disk_evicted_keys(log_events: list[dict]) -> set[bytes]:
    """The keys the service gave up for the disk tier as ``evicted``."""
    return {
        bytes.fromhex(name)
        for event in log_events
        if is_disk_eviction(event)
        for name in event.get("keys", [])
    }


def check_disk_evictions(evicted: set[bytes]) -> list[Violation]:
    """Blocks that left the pool before reaching the disk tier are losses."""
    if not evicted:
        return []
    return [
        Violation(
            "evicted_before_reaching_disk",
            {"count": len(evicted), "keys": sorted(k.hex() for k in evicted)[:10]},
        )
    ]


def excused_keys(log_events: list[dict]) -> dict[bytes, str]:
    """Keys the service logged as given up or lost by a tier, with the first excuse seen
    (a disk ``evicted`` drop excuses nothing)."""
    excused: dict[bytes, str] = {}
    for event in log_events:
        excuse = LOSS_EVENTS.get(event.get("event", ""))
        if excuse is None or is_disk_eviction(event):
            continue
        if "keys" in event:
            names = event["keys"]
        elif "key" in event:
            names = [event["key"]]
        else:
            names = [str(event.get("path", "")).rsplit("/", 1)[-1]]
        for name in names:
            try:
                excused.setdefault(bytes.fromhex(name), excuse)
            except ValueError:
                continue
    return excused


def check_acknowledged_blocks(missing: list[bytes], excused: dict[bytes, str]) -> list[Violation]:
    """A block acknowledged to an engine that did not come back is a violation unless excused."""
    lost = [key for key in missing if key not in excused]
    if not lost:
        return []
    return [
        Violation(
            "acknowledged_block_lost", {"count": len(lost), "keys": [k.hex() for k in lost[:10]]}
        )
    ]


def check_rss(peak_bytes: int, limit_bytes: int) -> list[Violation]:
    if peak_bytes > limit_bytes:
        return [
            Violation(
                "manager_rss_over_limit",
                {"peak_mb": peak_bytes >> 20, "limit_mb": limit_bytes >> 20},
            )
        ]
    return []


def check_leftovers(
    shm: list[str], runtime_files: list[str], processes: list[int], client_segments: list[str]
) -> list[Violation]:
    found = {
        "shm": shm,
        "runtime_files": runtime_files,
        "processes": processes,
        "client_segments": client_segments,
    }
    found = {k: v for k, v in found.items() if v}
    return [Violation("leftovers", found)] if found else []


class IncarnationTotals:
    """Counters that restart with their process (a manager's tier counters, a worker's stats):
    the latest snapshot per (incarnation, group), summed over incarnations per group."""

    def __init__(self) -> None:
        self._latest: dict[tuple[Any, str], dict[str, float]] = {}

    def update(self, incarnation: Any, group: str, counters: dict[str, Any]) -> None:
        numeric = {
            k: v
            for k, v in counters.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        self._latest[(incarnation, group)] = numeric

    def totals(self) -> dict[str, dict[str, float]]:
        out: dict[str, Counter] = {}
        for (_, group), counters in self._latest.items():
            out.setdefault(group, Counter()).update(counters)
        return {group: dict(sorted(c.items())) for group, c in sorted(out.items())}
