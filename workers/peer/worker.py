"""The peer worker's backend: promotions from other nodes' pools and disks (docs/fleet.md).

It holds nothing of its own. Its index is what the followed nodes announce on their node
streams (``follow.Followers`` over ``index.PeerIndex``), reported to the manager as the peer
tier's index; it serves this node's blocks to the nodes that follow it
(``serve.FetchServer``, when ``peer.fetch_endpoint`` is set).

``promotion`` (the only job kind): for each key, the first node of the index that holds it and
whose breaker is closed is asked, the keys of one node and tenant together in fetches of at most
``max_fetch_keys``. Each block received is opened into its pool slot (the one copy; its seal
proves it came from the holder unchanged), checked against the checksum its holder's slot header
carries (xxh3, or its slices' combination), stamped into the slot's header, and reported
landed (``report_landed``) before the job ends. A key another node
did not have, or that failed there, is asked of its next holder while ``fetch_deadline_s``
lasts. A key no node could give fails for this job only (never ``absent``: a holder answers
for the tenant asking, and the index follows what the holders' streams tell, which is how a
key that left a holder leaves the index); a block that does not match its checksum is
dropped and counted. The manager falls through to the next tier, or a MISS for the waiting
request.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence

import zmq

from kvoffload.config import Config
from kvoffload.logs import get_logger
from kvoffload.memory.blockformat import BlockChecksum, block_checksum, deployment_fingerprint
from kvoffload.memory.pool import HostPool
from kvoffload.wire import protocol as p
from kvoffload.wire.status import PeerWorkerStats
from kvoffload.wire.tenant_ids import NO_TENANT, key_check
from kvoffload.wire.vocab import JobKind
from workers.backend import BackendOutcome, NoIndexBackend
from workers.faults import FaultInjector
from workers.jobs import REPORT_BYTES, LandedBatch
from workers.peer.fetch import FetchFailed, FetchFields, HolderLink, InFlight
from workers.peer.follow import Followers
from workers.peer.index import PeerIndex
from workers.peer.seal import SealBroken, open_into
from workers.peer.serve import FetchServer
from workers.slotheaders import SlotHeaders

log = get_logger()

PIPELINE_BYTES = 2 << 20
"""The blocks of one fetch, at most (a prefix goes as several, in flight together)."""
FETCHES_IN_FLIGHT = 4
"""Fetches of one promotion in flight at once: the holder seals one while this node opens
another."""

_COUNTERS = (
    "fetches",
    "fetch_failures",
    "fetch_keys",
    "fetch_bytes",
    "fetch_absent",
    "fetch_bad_blocks",
    "fallbacks",
)


class PeerBackend(NoIndexBackend):
    """The peer worker's ``Backend`` (module docstring). ``client_endpoint``: this node's
    manager, whose client the fetch server is."""

    name = "peer"
    medium = "remote"

    def __init__(self, cfg: Config, client_endpoint: str) -> None:
        self.capabilities = [JobKind.PROMOTION]
        self._cfg = cfg
        self._peer = cfg.peer
        self._client_endpoint = client_endpoint
        self._deployment = deployment_fingerprint(cfg.pool.block_bytes, cfg.pool.layout_id)
        self._tenant_check = key_check()
        self._lock = threading.Lock()
        self._index = PeerIndex(cfg.peer.max_indexed_keys)
        self._followers = Followers(
            cfg.peer.nodes, cfg.peer.curve_client_secret_file, self._index, self._lock
        )
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._links = {node.name: HolderLink(self._ctx, node, cfg.peer) for node in cfg.peer.nodes}
        self._server: FetchServer | None = None
        self._pool: HostPool | None = None
        self._headers: SlotHeaders | None = None
        self._fetch_ids = itertools.count(1)
        self._fixed = FetchFields(
            self._deployment, self._tenant_check, int(cfg.peer.holder_wait_s * 1000)
        )
        self._counters = dict.fromkeys(_COUNTERS, 0)

    @property
    def degraded(self) -> bool:
        """Some followed node is silent or its breaker open."""
        return bool(self._followers.silent_nodes) or any(
            link.breaker.open for link in self._links.values()
        )

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    # ---- Backend ------------------------------------------------------------------------------

    def job_threads(self, cfg: Config) -> int:
        return cfg.peer.io_threads

    def cpu_affinity(self, cfg: Config) -> tuple[int, ...]:
        return cfg.peer.cpu_affinity

    def use_slot_headers(self, headers: SlotHeaders) -> None:
        """Stamp the slot of every key a promotion lands; read them to serve (checksums)."""
        self._headers = headers

    def start(self, pool: HostPool, faults: FaultInjector) -> None:
        self._pool = pool
        if self._peer.fetch_endpoint:
            self._server = FetchServer(
                self._cfg,
                self._client_endpoint,
                pool,
                self._headers,
                self._deployment,
                self._tenant_check,
            )
            self._server.start()
        self._followers.start()

    def initial_index(self) -> Iterable[list[bytes]]:
        with self._lock:
            return [self._index.announce_all()]

    def take_index_changes(self) -> tuple[list[bytes], list[bytes]]:
        with self._lock:
            return self._index.take_changes()

    def run_job(self, job: p.Job) -> BackendOutcome:
        if job.kind != JobKind.PROMOTION:
            return BackendOutcome(ok_keys=[], error=f"unsupported_kind: {job.kind!r}")
        return self._promote(job)

    def stats(self) -> PeerWorkerStats:
        follow = self._followers.stats
        served = self._server.stats if self._server is not None else None
        with self._lock:
            counters = dict(self._counters)
            indexed, not_indexed = len(self._index), self._index.keys_not_indexed
        return PeerWorkerStats(
            nodes_followed=len(self._links),
            nodes_silent=len(self._followers.silent_nodes),
            keys_indexed=indexed,
            keys_not_indexed=not_indexed,
            stream_snapshots=follow.snapshots,
            stream_catch_ups=follow.catch_ups,
            breakers_open=sum(link.breaker.open for link in self._links.values()),
            served_fetches=served.fetches if served else 0,
            served_keys=served.keys_served if served else 0,
            served_bytes=served.bytes_served if served else 0,
            served_absent=served.keys_absent if served else 0,
            served_answers_lost=served.answers_lost if served else 0,
            refused=dict(served.refused) if served else {},
            handshakes_refused=self._server.handshake_refusals() if self._server else {},
            **counters,
        )

    def close(self) -> None:
        self._followers.close()
        if self._server is not None:
            self._server.close()
        for link in self._links.values():
            link.close()
        self._ctx.term()

    # ---- promotions ---------------------------------------------------------------------------

    def _promote(self, job: p.Job) -> BackendOutcome:
        assert self._pool is not None
        pool = self._pool
        tenants = job.tenants or [NO_TENANT] * len(job.keys)
        slot_of = dict(zip(job.keys, job.slots, strict=True))
        tenant_of = dict(zip(job.keys, tenants, strict=True))
        deadline = time.monotonic() + self._peer.fetch_deadline_s
        asked: dict[bytes, set[str]] = {key: set() for key in job.keys}
        failure: dict[bytes, str] = {}
        """Keys that failed transiently somewhere (not just absent): why, the last time."""
        landed: set[bytes] = set()
        report = LandedBatch(max(1, REPORT_BYTES // pool.block_bytes))
        todo = list(job.keys)
        while todo and time.monotonic() < deadline:
            plan = self._plan(todo, asked, tenant_of)
            if not plan:
                break
            step = min(self._peer.max_fetch_keys, max(1, PIPELINE_BYTES // pool.block_bytes))
            chunks = [
                (node, tenant, keys[start : start + step])
                for (node, tenant), keys in plan.items()
                for start in range(0, len(keys), step)
            ]
            in_flight: deque[tuple[str, list[bytes], InFlight | None]] = deque()
            for node, tenant, chunk in chunks:
                for key in chunk:
                    asked[key].add(node)
                in_flight.append((node, chunk, self._begin(job, node, tenant, chunk, failure)))
                while len(in_flight) >= FETCHES_IN_FLIGHT:
                    self._finish(
                        job, *in_flight.popleft(), deadline, slot_of, failure, landed, report
                    )
            while in_flight:
                self._finish(job, *in_flight.popleft(), deadline, slot_of, failure, landed, report)
            report.flush()
            todo = [key for key in todo if key not in landed]
        ok = [key for key in job.keys if key in landed]
        failed = [key for key in job.keys if key not in landed]
        error = ""
        if failed:
            self._count(fallbacks=len(failed))
            first = failure.get(failed[0], "no node to ask")
            error = f"{len(failed)} of {len(job.keys)} keys failed, first: {first}"
        return BackendOutcome(ok_keys=ok, nbytes=len(ok) * pool.block_bytes, error=error)

    def _plan(
        self,
        keys: Sequence[bytes],
        asked: dict[bytes, set[str]],
        tenant_of: dict[bytes, str],
    ) -> dict[tuple[str, str], list[bytes]]:
        """Each key's next node to ask (the first holder not asked yet whose breaker is
        closed), grouped by node and tenant; keys without one are left out."""
        plan: dict[tuple[str, str], list[bytes]] = {}
        with self._lock:
            holders = {key: self._index.holders(key) for key in keys}
        for key in keys:
            for node in holders[key]:
                link = self._links.get(node)
                if node not in asked[key] and link is not None and link.breaker.allow():
                    plan.setdefault((node, tenant_of[key]), []).append(key)
                    break
        return plan

    def _begin(
        self, job: p.Job, node: str, tenant: str, keys: list[bytes], failure: dict[bytes, str]
    ) -> InFlight | None:
        """Send a fetch of ``keys`` to ``node``; None (their reason in ``failure``) when it
        cannot be sent."""
        self._count(fetches=1)
        try:
            return self._links[node].begin(keys, tenant, next(self._fetch_ids), self._fixed)
        except FetchFailed as exc:
            self._fetch_failed(job, node, keys, exc, failure)
            return None

    def _fetch_failed(
        self,
        job: p.Job,
        node: str,
        keys: list[bytes],
        exc: FetchFailed,
        failure: dict[bytes, str],
    ) -> None:
        self._count(fetch_failures=1)
        log.warning(
            "peer_fetch_failed", node=node, job_id=job.job_id, keys=len(keys), reason=str(exc)
        )
        for key in keys:
            failure[key] = f"{node}: {exc.reason}"

    def _finish(
        self,
        job: p.Job,
        node: str,
        keys: list[bytes],
        fetch: InFlight | None,
        deadline: float,
        slot_of: dict[bytes, int],
        failure: dict[bytes, str],
        landed: set[bytes],
        report: LandedBatch,
    ) -> None:
        """Take the answer of ``fetch`` (keys ``keys`` of ``node``): its blocks into their
        slots, each landed one into ``landed`` and ``report``, the others' reasons into
        ``failure``."""
        assert self._pool is not None
        if fetch is None:
            return
        timeout = max(0.001, deadline - time.monotonic())
        try:
            fetched = self._links[node].finish(fetch, timeout, self._pool.block_bytes)
        except FetchFailed as exc:
            self._fetch_failed(job, node, keys, exc, failure)
            return
        blocks = fetched.blocks
        wanted = set(keys)
        got = 0
        for i, (key, frame, checksum) in enumerate(
            zip(blocks.keys, fetched.frames, blocks.checksums, strict=True), start=1
        ):
            if key not in wanted or key in landed:
                continue
            nonce = p.peer_seal_nonce(fetched.fetch_id, i)
            digests = self._land(job, slot_of[key], key, fetched.key, nonce, frame, checksum)
            if digests is None:
                failure[key] = f"{node}: bad_checksum"
                continue
            landed.add(key)
            failure.pop(key, None)
            report.add(key, digests)
            got += 1
        for reason, missing in (("holder_failed", blocks.failed), ("absent", blocks.absent)):
            for key in missing:
                if key in wanted and key not in landed:
                    failure[key] = f"{node}: {reason}"
        self._count(
            fetch_keys=got,
            fetch_bytes=got * self._pool.block_bytes,
            fetch_absent=len(blocks.absent),
        )

    def _land(
        self,
        job: p.Job,
        slot: int,
        key: bytes,
        seal_key: bytes,
        nonce: bytes,
        frame: zmq.Frame,
        checksum: p.PeerChecksum,
    ) -> list[int] | None:
        """Open the sealed ``frame`` into ``slot`` (the one copy), check it against
        ``checksum`` and stamp the slot; returns the block's digests, None (counted, logged)
        when the frame does not open or the bytes do not match."""
        assert self._pool is not None
        view = self._pool.slot_array(slot)
        try:
            open_into(seal_key, nonce, frame.buffer, self._pool.slot(slot))
        except SealBroken:
            self._count(fetch_bad_blocks=1)
            log.warning("peer_block_unsealable", job_id=job.job_id, key=key.hex(), slot=slot)
            return None
        if block_checksum(view, checksum.slices, checksum.slice_bytes) != checksum.value:
            self._count(fetch_bad_blocks=1)
            log.warning("peer_block_corrupt", job_id=job.job_id, key=key.hex(), slot=slot)
            return None
        stamped = BlockChecksum(checksum.value, checksum.slices, checksum.slice_bytes)
        if self._headers is None:
            return stamped.digests(view)
        try:
            return self._headers.stamp(slot, key, job.job_id, stamped)
        except ValueError:
            self._count(fetch_bad_blocks=1)
            log.warning("peer_block_corrupt", job_id=job.job_id, key=key.hex(), slot=slot)
            return None
