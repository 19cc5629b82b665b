"""vLLM's ``OffloadingManager`` on top of a kvoffload service (runs in the scheduler process).

Lookups. vLLM asks one key at a time and keeps asking while a key is uncertain. The manager
answers from a per-request table and queues every key it cannot answer yet as RETRY (or
HIT_PENDING, if kvoffload said so last time); ``on_schedule_end`` sends one pinned
``lookup`` per request with that step's queued keys. Every HIT in the reply is pinned for this
engine in the same round trip, so ``prepare_load`` never fails: it only hands over the slots.

Pins. A pinned key is released after its load, or, if vLLM never loads it, when its request
finishes; the release is sent without waiting for its reply (the service handles this
engine's calls in order), as are a store's completion and a request's finish: vLLM's scheduler
never waits on them. ``complete_load`` only queues its release: vLLM calls it while it turns
the step's output into tokens, so the release is sent with the next step's calls
(``on_schedule_end``), or before a request's finish or the shutdown, whichever comes first;
the engine keeps stepping while one is queued (``has_pending_work``). An error the service
answers to one is logged (``kvoffload_unawaited_call_failed``) once a later call reads it.
``reset_cache`` and a lost service session drop every pin at the service, so the tables are
cleared with them (and the queued releases with them).

Landings. With ``landing`` (loads are verified), the lookups ask the service to tell this
engine of the keys they promote as they land: the tier's worker sends each to the scheduler's
landing pipe (``KVOffloadClient.take_landed``), and the key is pinned then, so no lookup is
sent for it again. The manager takes the notices before the step's first lookup of a waiting
request (``take_landings``), and the connector waits for them (``wait_for_landings``, at most
``idle_wait_ms`` a step) while the engine has nothing else to run, instead of stepping idle. A
key not told within ``LANDING_WAIT_S`` is released and asked again by lookup.

Failed loads. A worker that could not load a key reports it (``note_failed_loads``); that key
is a MISS for that request from then on, so vLLM recomputes it once and never loops.

The reset fence. At ``reset_cache`` this engine's workers may still write slots its flushed
stores reserved, and read slots its flushed loads pinned. Those slots must not be handed to other
keys before the workers reported those jobs, so, when vLLM (or the connector) calls
``on_reset_flushed`` (``expect_reset_flushed``), the service's pool is emptied only then. Until
then this engine answers MISS and drops its stores: what it would find or store now is gone at
the service's reset. Without a caller of ``on_reset_flushed`` the pool is emptied at once.

Tenants. A request's tenant is named by its ``cache_salt`` (``TenantNames``, told by the
connector), else by the engine's ``namespace``; the service hears only its ``tenant_id``. Keys
of different tenants already differ: vLLM hashes the salt into every block hash, and the
namespace is part of the key fingerprint.

No fate-sharing. Every call goes through ``ServiceLink``: bounded by a timeout, and answered
locally while the service is unreachable (lookups MISS, stores dropped and counted). Nothing
raises into vLLM's scheduler loop; requests are registered again with a restarted service.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.client import KVOffloadClient, KVOffloadError, LookupOutcome
from kvoffload.integrations.vllm import integration_logger
from kvoffload.integrations.vllm.blocks import NO_SLOT, PoolBlocks
from kvoffload.integrations.vllm.compat import VLLM_FENCES_RESETS
from kvoffload.integrations.vllm.events import ServiceEvents
from kvoffload.integrations.vllm.keys import namespaced, namespaced_all, offload_key_of
from kvoffload.integrations.vllm.link import ServiceDown, ServiceLink
from kvoffload.integrations.vllm.metrics import ConfigInfo, Counter, StatsAccumulator
from kvoffload.integrations.vllm.requests import EngineRequest, TenantNames, lookup_queued
from kvoffload.integrations.vllm.settings import IDLE_LANDING_WAIT_MS
from kvoffload.wire.protocol import Landed, Slots

log = integration_logger(__name__)

RESET_TIMEOUT_S = 5.0
"""Bound of ``reset_cache`` (the service drains its jobs first, which takes milliseconds)."""
LANDING_WAIT_S = 5.0
"""How long keys wait for their landing notice before they are asked again by lookup (a
worker that died tells nothing)."""


class KVOffloadManager(OffloadingManager):
    def __init__(
        self,
        link: ServiceLink,
        fingerprint: bytes,
        *,
        secondary_source: CacheHitSource = CacheHitSource.DISK,
        engine_info: Mapping[str, str | int | float | bool] | None = None,
        endpoint_setting: str = "",
        slices: int = 1,
        slice_bytes: int = 0,
        namespace: str = "",
        events: ServiceEvents | None = None,
        landing: bool = False,
        idle_wait_ms: int = IDLE_LANDING_WAIT_MS,
    ) -> None:
        """``secondary_source``: how vLLM's hit-source metrics label blocks that kvoffload
        promoted from one of its secondary tiers (blocks already in its host pool are HOST).
        ``engine_info``: this engine's facts for ``config_info``; ``endpoint_setting``: the
        endpoint the settings name ("" when it is discovered). ``slices``: the digests a
        stored block needs (one per tensor-parallel rank's slice of ``slice_bytes``, or one for
        a block one rank writes whole): a block stamped with fewer is never served.
        ``namespace``: the tenant of this engine's requests that carry no ``cache_salt``.
        ``events``: the service's tier events (``take_events``), when vLLM's are on.
        ``landing``: ask for landing notices (the link's clients take them; loads verify).
        ``idle_wait_ms``: the bound of ``wait_for_landings``."""
        self._link = link
        self._fingerprint = fingerprint
        self._secondary_source = secondary_source
        self._requests: dict[str, EngineRequest] = {}
        self._touched: dict[bytes, None] = {}
        self._failed_stores: set[bytes] = set()
        self._store_checksums: dict[bytes, dict[int, int]] = {}
        self._store_order: dict[bytes, int] = {}
        self._store_sequence = itertools.count()
        self._slices = slices
        self._slice_bytes = slice_bytes if slices > 1 else 0
        self.stats = StatsAccumulator()
        self._outages_seen = 0
        self._generation_seen = link.generation
        self._windows: dict[int, int | None] = {}
        self._fence_caller = VLLM_FENCES_RESETS
        self._fenced = False
        self._config_info = ConfigInfo(engine_info or {}, endpoint_setting)
        self.tenants = TenantNames(namespace)
        self._events = events
        self._landing = landing
        self._idle_wait_ms = idle_wait_ms
        self._tickets: dict[int, tuple[str, float]] = {}
        """Tickets of lookups whose promotions tell their landings: (request, asked at)."""
        self._landings_taken = False
        self._releases: list[tuple[str, list[bytes], int]] = []
        """Loaded keys to unpin at the next ``send_releases``: (request, keys, generation)."""

    def set_sliding_windows(self, windows: dict[int, int | None]) -> None:
        """vLLM's KV cache group index -> the chunks of it a resumed request reads (None: full
        attention). Lookups of a group absent here are those of full attention."""
        self._windows = dict(windows)

    def set_secondary_source(self, source: CacheHitSource) -> None:
        self._secondary_source = source

    # ---- helpers --------------------------------------------------------------------------

    def _keys(self, keys: Iterable[OffloadKey]) -> list[bytes]:
        return namespaced_all(self._fingerprint, keys)

    def _state(self, ctx: ReqContext) -> EngineRequest:
        state = self._requests.get(ctx.req_id)
        if state is None:
            state = self._requests[ctx.req_id] = EngineRequest(ctx)
        return state

    def _forget_session_state(self, state: EngineRequest) -> None:
        """The service session that held this request's pins is gone."""
        state.generation = -1
        state.pinned.clear()
        state.uncertain.clear()
        state.promoted.clear()
        state.landing.clear()

    def _sync_generation(self) -> None:
        """After a reconnect every pin and registration of the old session is gone."""
        generation = self._link.generation
        if generation == self._generation_seen:
            return
        self._generation_seen = generation
        self._tickets.clear()
        for state in self._requests.values():
            if state.generation not in (-1, generation):
                self._forget_session_state(state)

    def _ensure_registered(self, client: KVOffloadClient, state: EngineRequest) -> bool:
        if state.generation == self._link.generation:
            return False
        if state.generation != -1:
            self._forget_session_state(state)
        level = client.new_request(
            state.ctx.req_id, _service_params(state.ctx), tenant=state.tenant
        )
        state.generation = self._link.generation
        return level

    def _count_outage(self) -> None:
        if self._link.outages != self._outages_seen:
            self.stats.add(Counter.SERVICE_OUTAGES, self._link.outages - self._outages_seen)
            self._outages_seen = self._link.outages

    # ---- requests -------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        state = EngineRequest(req_context, self.tenants.take(req_context.req_id))
        self._requests[req_context.req_id] = state
        try:
            request_level = self._link.call(lambda c: self._ensure_registered(c, state))
        except (ServiceDown, KVOffloadError) as exc:
            log.debug("kvoffload_new_request_failed req_id=%s error=%s", req_context.req_id, exc)
            return RequestOffloadingContext()
        finally:
            self._count_outage()
        policy = OffloadPolicy.REQUEST_LEVEL if request_level else OffloadPolicy.CHUNK_LEVEL
        return RequestOffloadingContext(policy=policy)

    def on_request_finished(self, req_context: ReqContext) -> None:
        state = self._requests.get(req_context.req_id)
        if state is None:
            return
        state.finished = True
        state.queued.clear()
        state.landing.clear()  # the service drops the request's landing waits at its finish
        self.send_releases()
        self._release_unloaded_pins(state)
        if state.generation == self._link.generation and self._link.up:
            try:
                self._link.call(lambda c: c.finish_request(state.ctx.req_id, wait=False))
            except (ServiceDown, KVOffloadError) as exc:
                log.debug("kvoffload_finish_failed req_id=%s error=%s", state.ctx.req_id, exc)
            self._count_outage()
        self._maybe_forget(state)

    def _maybe_forget(self, state: EngineRequest) -> None:
        if state.finished and not state.loading and not state.open_stores:
            self._requests.pop(state.ctx.req_id, None)

    # ---- lookups --------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._sync_generation()
        state = self._state(req_context)
        if state.landing and not self._landings_taken:
            self.take_landings()
        nkey = namespaced(self._fingerprint, key)
        if nkey in state.pinned:
            return LookupResult.HIT
        if nkey in state.missed or nkey in state.failed or self._fenced:
            return LookupResult.MISS
        if nkey in state.landing:
            state.queued[nkey] = None  # answered at the step's end without asking (requests)
            return LookupResult.HIT_PENDING
        if not self._link.ready():
            state.missed.add(nkey)
            self.stats.add(Counter.MISS_BLOCKS)
            return LookupResult.MISS
        state.queued[nkey] = None
        return state.uncertain.get(nkey, LookupResult.RETRY)

    def ask_now(self, req_context: ReqContext, keys: Iterable[OffloadKey]) -> None:
        """Look ``keys`` up at once (one pinned round trip), so the lookups vLLM makes next in
        this step are answered without waiting for the step's end. Keys already answered for
        good, or still pending from an earlier answer (asked again at the step's end), are
        left out, so a request costs one lookup per step; the same keys asked again before any
        of the request's answers changed are not looked at again (a step that waits for
        landings)."""
        self._sync_generation()
        state = self._state(req_context)
        if state.finished or self._fenced or not self._link.ready():
            return
        asked = tuple(keys)
        if state.asked_now == (asked, state.answers_signature()):
            return  # nothing learnt since the same keys were asked (a step waiting for landings)
        for nkey in self._keys(asked):
            if nkey in state.uncertain and nkey not in state.landing:
                # Asked before and still pending: vLLM's lookups queue it for the step's end.
                continue
            if nkey not in state.pinned and nkey not in state.missed and nkey not in state.failed:
                state.queued[nkey] = None
        if state.queued:
            self._lookup_batch(state)
            self._count_outage()
        state.asked_now = (asked, state.answers_signature())

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        state = self._requests.get(req_context.req_id)
        if state is not None and namespaced(self._fingerprint, key) in state.promoted:
            return self._secondary_source
        return CacheHitSource.HOST

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._sync_generation()
        self._landings_taken = False
        self.send_releases()
        for state in list(self._requests.values()):
            if state.queued and not state.finished:
                self._lookup_batch(state)
        if self._touched:
            keys, self._touched = list(self._touched), {}
            with contextlib.suppress(ServiceDown, KVOffloadError):
                self._link.call(lambda c: c.touch(keys))
        self._count_outage()

    def _lookup_batch(self, state: EngineRequest) -> None:
        def ask(client: KVOffloadClient, batches: list[list[bytes]]) -> list[LookupOutcome]:
            self._ensure_registered(client, state)
            outcomes = client.lookup_many(
                state.ctx.req_id, batches, pin=True, landing=self._landing
            )
            for outcome in outcomes:
                if outcome.ticket:
                    self._tickets[outcome.ticket] = (state.ctx.req_id, time.monotonic())
            return outcomes

        lookup_queued(state, self._link, ask, self._windows, self.stats, self._sync_generation)

    # ---- landings -------------------------------------------------------------------------

    def awaiting_landings(self) -> bool:
        """Some request waits for keys whose landing the service will tell."""
        return bool(self._tickets)

    def awaits_landings(self, req_id: str) -> bool:
        """The request waits for keys whose landing the service will tell."""
        state = self._requests.get(req_id)
        return state is not None and bool(state.landing)

    def take_landings(self, timeout_ms: int = 0) -> None:
        """Take the landing notices received (waiting up to ``timeout_ms`` for the first): a
        key told landed is pinned for its request (a HIT from a secondary tier), one told
        failed is a MISS; keys of a job that ended without telling them, or whose ticket is
        older than ``LANDING_WAIT_S``, are released and asked again by lookup."""
        self._landings_taken = True
        if not self._tickets:
            return
        try:
            notices = self._link.call(lambda c: c.take_landed(timeout_ms))
        except (ServiceDown, KVOffloadError):
            notices = []
        self._count_outage()
        now = time.monotonic()
        for notice in notices:
            entry = self._tickets.get(notice.ticket)
            state = self._requests.get(entry[0]) if entry is not None else None
            if state is not None and not state.finished:
                self._apply_landed(state, notice)
            if notice.final:
                self._tickets.pop(notice.ticket, None)
        for ticket, (req_id, asked_at) in list(self._tickets.items()):
            if now - asked_at > LANDING_WAIT_S:
                del self._tickets[ticket]
                log.warning("kvoffload_landing_timeout req_id=%s ticket=%d", req_id, ticket)
        for state in self._requests.values():
            untold = [k for k, t in state.landing.items() if t not in self._tickets]
            if untold:
                for key in untold:
                    del state.landing[key]
                    state.uncertain.pop(key, None)
                self._unpin(state.ctx.req_id, untold, state.generation)

    def _apply_landed(self, state: EngineRequest, notice: Landed) -> None:
        landing = state.landing
        for key, slot, digests in zip(notice.keys, notice.slots, notice.checksums, strict=True):
            if landing.get(key) == notice.ticket:
                del landing[key]
                state.uncertain.pop(key, None)
                state.pinned[key] = (slot, digests)
                state.promoted.add(key)
                self.stats.add(Counter.HIT_BLOCKS, 1, "secondary")
        for key in notice.failed:
            if landing.get(key) == notice.ticket:
                del landing[key]
                state.uncertain.pop(key, None)
                state.missed.add(key)
                self.stats.add(Counter.MISS_BLOCKS)

    def wait_for_landings(self) -> None:
        """The engine has nothing else to run: take landing notices for up to
        ``idle_wait_ms``, instead of stepping idle, and return as soon as a request that waited
        for landings waits for none any more (it can then be scheduled), or none is awaited."""
        timeout_ms = self._idle_wait_ms
        deadline = time.monotonic() + timeout_ms / 1000
        waiting = [state for state in self._requests.values() if state.landing]
        if not waiting:  # only a job's last notice is awaited: one wait for it
            if self._tickets:
                self.take_landings(timeout_ms)
            return
        while self._tickets:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return
            self.take_landings(left_ms)
            if any(not state.landing for state in waiting):
                return

    # ---- loads ----------------------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """The pinned slots of ``keys``; a key that is not pinned (the session was lost since
        its lookup) gets ``NO_SLOT``, so its load fails and vLLM recomputes it."""
        state = self._state(req_context)
        nkeys = self._keys(keys)
        pinned = [state.pinned.pop(k, (NO_SLOT, [])) for k in nkeys]
        slots = [slot for slot, _ in pinned]
        state.loading.update(k for k, s in zip(nkeys, slots, strict=True) if s != NO_SLOT)
        state.load_generation = self._link.generation
        self._release_unloaded_pins(state)
        checksums = [digests for _, digests in pinned]
        return PoolBlocks.in_pool(self._link.info, req_context.req_id, nkeys, slots, checksums)

    def _release_unloaded_pins(self, state: EngineRequest) -> None:
        """Once vLLM has chosen what a request loads, the request's other hits will not be
        read (a sliding-window group's lookups pin every hit they scan, and only the window is
        loaded): release their pins now instead of when the request finishes. Should vLLM
        look them up again (a preempted request), they are asked again."""
        unused = list(state.pinned)
        state.pinned.clear()
        self._unpin(state.ctx.req_id, unused, state.generation)

    def _unpin(self, req_id: str, keys: list[bytes], generation: int) -> None:
        """Release this engine's pins of ``keys`` at the service (without waiting for the
        reply) if the session that took them (``generation``) is still the link's."""
        if keys and generation == self._link.generation and self._link.up:
            try:
                self._link.call(lambda c: c.complete_load(req_id, keys, wait=False))
            except (ServiceDown, KVOffloadError) as exc:
                log.debug("kvoffload_unpin_failed req_id=%s error=%s", req_id, exc)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        state = self._requests.get(req_context.req_id)
        if state is None:
            return
        loading = state.loading
        release = [k for k in self._keys(keys) if loading[k] > 0]
        state.loading.subtract(release)
        state.loading = +state.loading
        if release:
            self._releases.append((req_context.req_id, release, state.load_generation))
        self._maybe_forget(state)

    def send_releases(self) -> None:
        """Send the releases ``complete_load`` queued (each without waiting for its reply)."""
        releases, self._releases = self._releases, []
        for req_id, keys, generation in releases:
            self._unpin(req_id, keys, generation)

    def hits_in_pool(self, req_id: str, keys: Iterable[OffloadKey]) -> bool:
        """Whether every key is pinned for the request in the host pool (found there by its
        lookup, or told landed there by a promotion), so its load can be done at once."""
        state = self._requests.get(req_id)
        if state is None:
            return False
        pinned = state.pinned
        return all(k in pinned for k in self._keys(keys))

    def note_failed_loads(self, req_id: str, nkeys: Iterable[bytes]) -> None:
        """Loads of ``nkeys`` failed in a worker: MISS for this request from now on."""
        state = self._requests.get(req_id)
        nkeys = list(nkeys)
        self.stats.add(Counter.LOAD_FAILED_BLOCKS, len(nkeys))
        if state is not None:
            state.failed.update(nkeys)
        log.warning("kvoffload_load_failed req_id=%s blocks=%d", req_id, len(nkeys))

    def note_failed_stores(self, nkeys: Iterable[bytes]) -> None:
        """Stores of ``nkeys`` failed in a worker: their ``complete_store`` reports failure."""
        self._failed_stores.update(nkeys)

    def note_store_checksums(self, checksums: dict[bytes, dict[int, int]]) -> None:
        """Each rank's digest (by slice index) of the slots the workers wrote, sent with
        ``complete_store`` once every rank's is in, so the service stamps those slots and
        keeps the blocks across a manager restart."""
        for key, digests in checksums.items():
            self._store_checksums.setdefault(key, {}).update(digests)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._touched.update(dict.fromkeys(self._keys(keys)))

    # ---- stores ---------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        state = self._state(req_context)
        nkeys = self._keys(keys)
        if self._fenced:
            # Slots reserved now would be emptied by the service's reset under the workers.
            self.stats.add(Counter.STORES_DROPPED, len(nkeys), "reset")
            return None

        def call(client: KVOffloadClient) -> Slots:
            self._ensure_registered(client, state)
            return client.prepare_store(req_context.req_id, nkeys)

        try:
            slots = self._link.call(call)
        except ServiceDown:
            self.stats.add(Counter.STORES_DROPPED, len(nkeys), "unreachable")
            self._count_outage()
            return None
        except KVOffloadError as exc:
            self.stats.add(Counter.STORES_DROPPED, len(nkeys), exc.code)
            log.debug("kvoffload_store_refused req_id=%s error=%s", req_context.req_id, exc)
            return None
        if slots.keys:
            state.open_stores += 1
        for nkey in slots.keys:
            self._store_order[nkey] = next(self._store_sequence)
        spec = PoolBlocks.in_pool(
            self._link.info, req_context.req_id, list(slots.keys), list(slots.slots)
        )
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(offload_key_of(k)) for k in slots.keys],
            store_spec=spec,
            evicted_keys=[
                OffloadKey(offload_key_of(k))
                for k in slots.evicted
                if k.startswith(self._fingerprint)
            ],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        state = self._requests.get(req_context.req_id)
        # vLLM hands the keys over as a set: send them in the order they were prepared (a
        # prefix's order), which the service's tiers keep, so a prefix lies on disk in
        # consecutive records that a promotion reads back together.
        order = self._store_order
        nkeys = sorted(self._keys(keys), key=lambda nkey: order.get(nkey, -1))
        for nkey in nkeys:
            order.pop(nkey, None)
        failed = self._failed_stores.intersection(nkeys)
        self._failed_stores.difference_update(failed)
        digests = [self._store_checksums.pop(k, {}) for k in nkeys]
        # a block without every rank's digest is not ready: it is never stamped nor served
        incomplete = {k for k, d in zip(nkeys, digests, strict=True) if len(d) < self._slices}
        failed |= incomplete
        ok = [k for k in nkeys if k not in failed] if success else []
        checksums = [[d.get(i, 0) for i in range(self._slices)] for d in digests]
        if state is not None:
            state.open_stores = max(0, state.open_stores - 1)
        try:
            if state is None or state.generation != self._link.generation:
                raise ServiceDown("the session that prepared this store is gone")
            self._link.call(
                lambda c: c.complete_store(
                    req_context.req_id,
                    nkeys,
                    success=not failed and success,
                    successful_keys=ok if failed else None,
                    checksums=checksums,
                    slice_bytes=self._slice_bytes,
                    wait=False,
                )
            )
        except (ServiceDown, KVOffloadError) as exc:
            self.stats.add(Counter.STORES_DROPPED, len(ok), "unreachable")
            log.debug("kvoffload_store_lost req_id=%s error=%s", req_context.req_id, exc)
        else:
            self.stats.add(Counter.STORED_BLOCKS, len(ok))
            if failed - incomplete:
                self.stats.add(Counter.STORES_DROPPED, len(failed - incomplete), "copy_failed")
            if incomplete:
                self.stats.add(Counter.STORES_DROPPED, len(incomplete), "checksum_missing")
        self._count_outage()
        if state is not None:
            self._maybe_forget(state)

    # ---- cache ----------------------------------------------------------------------------

    def reset_cache(self) -> None:
        """Empty kvoffload's host pool (its disk and object tiers keep their blocks), behind
        the reset fence (module docstring). Every pin of this engine goes with it."""
        self._releases.clear()
        self._tickets.clear()
        for state in list(self._requests.values()):
            state.pinned.clear()
            state.landing.clear()
            state.uncertain.clear()
            state.missed.clear()
            state.queued.clear()
            state.loading.clear()
            state.open_stores = 0
            self._maybe_forget(state)
        self._touched.clear()
        if self._fence_caller:
            self._fenced = True
            log.info("kvoffload_reset_fenced: the pool is emptied once the flushed jobs report")
            return
        self._reset_service()

    def on_reset_flushed(self) -> None:
        """The workers reported every job in flight at the last ``reset_cache``: no slot
        they were given is written or read any more, so the service may empty its pool."""
        if not self._fenced:
            return
        self._fenced = False
        self._failed_stores.clear()
        self._store_checksums.clear()
        self._store_order.clear()
        self._reset_service()

    def expect_reset_flushed(self) -> None:
        """``on_reset_flushed`` will be called after each ``reset_cache`` (the connector
        promises it on vLLM versions that do not)."""
        self._fence_caller = True

    def has_pending_work(self) -> bool:
        """Between a ``reset_cache`` and its ``on_reset_flushed``, or while releases are
        queued: the engine keeps stepping while the reset waits for its flushed jobs' reports,
        and its next step sends the releases."""
        return self._fenced or bool(self._releases)

    def _reset_service(self) -> None:
        try:
            self._link.call(lambda c: c.reset_cache(timeout_s=RESET_TIMEOUT_S))
        except (ServiceDown, KVOffloadError) as exc:
            log.warning("kvoffload_reset_failed error=%s", exc)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """What the service's tiers gained and lost (``events``); nothing when events are off."""
        return self._events.take() if self._events is not None else ()

    def config_info(self) -> list[dict[str, str | int | float | bool]]:
        return self._config_info.labels(self._link)

    def get_stats(self) -> OffloadingConnectorStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        self.send_releases()
        self._link.close()


def _service_params(ctx: ReqContext) -> dict[str, Any]:
    """The request parameters kvoffload understands (its tier filter)."""
    params = ctx.kv_transfer_params or {}
    tiers = params.get("kv_load_tiers")
    return {"kv_load_tiers": tiers} if tiers is not None else {}
