"""The manager's side of the slot header table: keep it true, and rebuild from it after a restart.

Keeping it true: before any slot number leaves the manager (a job to a worker, a reply to a
client) and once per loop turn, ``clear_invalidated`` clears the header of every slot the
primary index freed or handed to a new key, so a header never describes a slot being rewritten.
Workers stamp a slot's header once its bytes are complete (see ``kvoffload.memory.slottable``).

Rebuilding: a restarted manager finds valid headers (a fresh run's table is all zeros). For each
key the header with the highest generation wins; the winners enter the primary index as
in-flight writes (HIT_PENDING) and the other headers are cleared. Once the cpu worker says hello
it gets ``verify`` jobs (keys + slots); it recomputes each slot's xxh3 and compares it with the
header. Verified keys become HIT; the others are freed and their headers cleared. A verify job
lost with its worker is sent again at the worker's next hello.

The manager maps only this metadata table, never the pool.
"""

from __future__ import annotations

import time

import structlog

from kvoffload.config import Config
from kvoffload.memory.blockformat import (
    BlockChecksum,
    BlockHeader,
    combine_checksums,
    deployment_fingerprint,
)
from kvoffload.memory.slottable import SlotTable
from kvoffload.runtime.runspec import RunSpec
from kvoffload.tiering import TieringLedger
from kvoffload.wire import protocol as p
from kvoffload.wire.status import WarmRestartStatus

log = structlog.get_logger()

VERIFY_BATCH_KEYS = 4096


def newest_per_key(
    found: list[tuple[int, BlockHeader]],
) -> tuple[list[tuple[bytes, int]], list[int]]:
    """Pick, for each key, the slot whose header has the highest generation (ties: the higher
    slot). Returns (winners as (key, slot) oldest generation first, the losing slots)."""
    best: dict[bytes, tuple[int, int]] = {}
    losers: list[int] = []
    for slot, header in found:
        candidate = (header.generation, slot)
        current = best.get(header.key)
        if current is None:
            best[header.key] = candidate
        elif candidate > current:
            losers.append(current[1])
            best[header.key] = candidate
        else:
            losers.append(slot)
    winners = sorted(best.items(), key=lambda item: item[1])
    return [(key, slot) for key, (_, slot) in winners], losers


class WarmRestart:
    """Slot header bookkeeping of one manager process. Build it with ``open``."""

    def __init__(
        self, table: SlotTable, fingerprint: bytes, tiering: TieringLedger, block_bytes: int
    ) -> None:
        self._table = table
        self._fingerprint = fingerprint
        self._block_bytes = block_bytes
        self._tiering = tiering
        self._verifying: dict[int, list[bytes]] = {}
        self._digests: dict[int, tuple[bytes, list[int]]] = {}
        """Per slot, the key and digests its header records, as last stamped or read here;
        dropped with the slot's invalidation (every header change follows one)."""
        self._started = time.monotonic()
        self._rebuilt_logged = False
        self.counters = {
            "headers_found": 0,
            "adopted": 0,
            "duplicates": 0,
            "verified": 0,
            "dropped": 0,
        }

    @classmethod
    def open(cls, spec: RunSpec, cfg: Config, tiering: TieringLedger) -> WarmRestart | None:
        """Attach the run's slot table and rebuild from it; None when slot headers are off.
        ``tiering`` must be unused and track slot invalidations."""
        if not spec.slot_table_name:
            return None
        table = SlotTable.attach(spec.slot_table_name, cfg.pool.num_slots)
        fingerprint = deployment_fingerprint(cfg.pool.block_bytes, cfg.pool.layout_id)
        warm = cls(table, fingerprint, tiering, cfg.pool.block_bytes)
        warm._rebuild()
        return warm

    def _rebuild(self) -> None:
        found = self._table.read_all(self._fingerprint)
        if not found:
            return
        winners, losers = newest_per_key(found)
        for slot in losers:
            self._table.clear(slot)
        self._tiering.adopt(winners)
        self.counters.update(headers_found=len(found), adopted=len(winners), duplicates=len(losers))
        log.info(
            "slot_headers_found", headers=len(found), adopted=len(winners), duplicates=len(losers)
        )

    def stamp(
        self, slot: int, key: bytes, digests: list[int], slice_bytes: int, generation: int
    ) -> None:
        """Describe ``slot`` as holding ``key`` whose bytes have ``digests``: the xxh3 of the
        whole slot, or of each of its slices of ``slice_bytes`` (a direct store that landed; a
        restarted manager verifies the slot before serving it)."""
        checksum = (
            BlockChecksum(combine_checksums(digests), len(digests), slice_bytes)
            if len(digests) > 1
            else BlockChecksum(digests[0])
        )
        header = checksum.header(key, self._block_bytes, self._fingerprint, generation)
        self._table.write(slot, header, digests)
        self._digests[slot] = (key, list(digests))

    def slice_checksums_of(self, slot: int, key: bytes) -> list[int]:
        """The digests the slot's header records for ``key`` (see ``stamp``); empty when the
        slot has no header for it (a write that stamps nothing, or slot headers off). Read
        from the table once per stamped slot, then from memory: a header changes only after
        the slot was invalidated, which drops what was read. The list is shared: read only."""
        known = self._digests.get(slot)
        if known is not None and known[0] == key:
            return known[1]
        header = self._table.read(slot, self._fingerprint)
        if header is None or header.key != key:
            return []
        digests = self._table.slice_checksums(slot, header)
        if digests:
            self._digests[slot] = (key, digests)
        return digests

    def checksums_of(self, keys: list[bytes], slots: list[int]) -> list[list[int]]:
        """``slice_checksums_of`` each (slot, key), empty for a slot of -1 (read only)."""
        known = self._digests
        out: list[list[int]] = []
        for key, slot in zip(keys, slots, strict=False):
            entry = known.get(slot)
            if entry is not None and entry[0] == key:
                out.append(entry[1])
            else:
                out.append(self.slice_checksums_of(slot, key) if slot >= 0 else [])
        return out

    def clear_invalidated(self) -> None:
        """Clear the headers of the slots the primary index freed or reassigned since the last call."""
        for slot in self._tiering.take_invalidated_slots():
            self._table.clear(slot)
            self._digests.pop(slot, None)

    def verify_jobs(self) -> list[p.Job]:
        """Verify jobs for every adopted key not already in a verify job in flight (tracked
        until ``verify_done`` or ``verify_lost``)."""
        in_flight = {key for keys in self._verifying.values() for key in keys}
        todo = [(key, slot) for key, slot in self._tiering.adopting() if key not in in_flight]
        jobs = []
        for start in range(0, len(todo), VERIFY_BATCH_KEYS):
            batch = todo[start : start + VERIFY_BATCH_KEYS]
            job = p.Job(
                self._tiering.next_job_id(),
                p.JobKind.VERIFY,
                [k for k, _ in batch],
                [s for _, s in batch],
            )
            self._verifying[job.job_id] = job.keys
            jobs.append(job)
        return jobs

    def owns(self, job_id: int) -> bool:
        return job_id in self._verifying

    def verify_done(self, job_id: int, success: bool, successful_keys: list[bytes] | None) -> None:
        """Apply a verify job's result: ok keys become HIT, the others are freed and their
        headers cleared. Logs ``primary_index_rebuilt`` once nothing awaits verification."""
        keys = self._verifying.pop(job_id)
        ok = keys if success else (successful_keys or [])
        ready, dropped = self._tiering.complete_adoption(keys, ok)
        self.counters["verified"] += len(ready)
        self.counters["dropped"] += len(dropped)
        self.clear_invalidated()
        if not self._rebuilt_logged and not self._tiering.adopting():
            self._rebuilt_logged = True
            log.info(
                "primary_index_rebuilt",
                headers_found=self.counters["headers_found"],
                verified=self.counters["verified"],
                dropped=self.counters["dropped"],
                duplicates=self.counters["duplicates"],
                duration_ms=round((time.monotonic() - self._started) * 1000, 3),
            )

    def verify_lost(self) -> None:
        """The cpu worker is gone: its verify jobs will get no result; their keys stay adopted
        and go out again with the next ``verify_jobs``."""
        self._verifying.clear()

    def snapshot(self) -> WarmRestartStatus:
        return WarmRestartStatus(**self.counters, unverified=len(self._tiering.adopting()))

    def close(self) -> None:
        self._table.close()
