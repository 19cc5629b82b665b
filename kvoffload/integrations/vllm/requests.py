"""What the scheduler side knows of each vLLM request, and how a request's queued lookups are
asked of the service and recorded (the manager's lookup path, ``manager`` uses it).

A request's keys are namespaced kvoffload keys. Every HIT the service answers is pinned for
this engine in the same round trip (``pinned``: slot and the block's digests), so a later
``prepare_load`` only hands the slots over; a MISS stays a MISS for the request; HIT_PENDING
and RETRY are asked again at a later step's end, but for keys whose landing the tier's worker
will tell (``landing``: key -> ticket), which the manager takes from its landing pipe
instead (``KVOffloadManager.take_landings``).
"""

from __future__ import annotations

import math
from collections import Counter as Multiset
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext

from kvoffload.client import KVOffloadClient, KVOffloadError, LookupOutcome
from kvoffload.integrations.vllm import integration_logger
from kvoffload.integrations.vllm.keys import group_of, offload_key_of
from kvoffload.integrations.vllm.link import ServiceDown, ServiceLink
from kvoffload.integrations.vllm.lookups import ask_by_group
from kvoffload.integrations.vllm.metrics import Counter, StatsAccumulator
from kvoffload.wire import vocab

log = integration_logger(__name__)

_VLLM_RESULT = {code.value: LookupResult[code.name] for code in vocab.LookupResult}
"""vLLM's lookup result of each of the service's result bytes."""


@dataclass
class EngineRequest:
    """What this engine knows of one vLLM request."""

    ctx: ReqContext
    tenant: str = ""  # the name of the request's tenant ("" for none)
    generation: int = -1  # link generation the request is registered at; -1: not registered
    pinned: dict[bytes, tuple[int, list[int]]] = field(default_factory=dict)  # (slot, digests)
    uncertain: dict[bytes, LookupResult] = field(default_factory=dict)  # last HIT_PENDING/RETRY
    missed: set[bytes] = field(default_factory=set)
    failed: set[bytes] = field(default_factory=set)  # loads that failed: MISS for good
    promoted: set[bytes] = field(default_factory=set)  # became HIT after waiting on a tier
    landing: dict[bytes, int] = field(default_factory=dict)  # being promoted: its ticket
    queued: dict[bytes, None] = field(default_factory=dict)  # to ask at the step's end
    loading: Multiset[bytes] = field(default_factory=Multiset)  # pinned, handed to a load
    load_generation: int = -1
    open_stores: int = 0
    finished: bool = False
    asked_now: tuple[tuple[OffloadKey, ...], tuple[int, ...]] | None = None
    """The keys of the last ``ask_now`` and the request's ``answers_signature`` after it."""

    def position(self, key: bytes) -> int | None:
        """The key's end token in the request, as vLLM's scheduler recorded it."""
        return self.ctx.get_offload_key_position(OffloadKey(offload_key_of(key)))

    def answers_signature(self) -> tuple[int, ...]:
        """Sizes of the request's answer sets that change whenever one of its keys gets a first
        answer, is pinned, misses, fails or is released, but not when a key told to land
        lands: a landing key counts as pinned already, and is left out of the pending ones
        (its answer was known; asking again would learn nothing). A pending key whose answer
        only changes kind keeps them too; ``ask_now`` does not ask such keys anyway."""
        return (
            len(self.pinned) + len(self.landing),
            len(self.missed),
            len(self.failed),
            len(self.uncertain) - len(self.landing),
        )

    def full_miss_position(self, windows: Mapping[int, int | None]) -> float:
        """The lowest end token at which a full-attention group of the request is MISS."""
        positions = [
            self.position(key)
            for key in (*self.missed, *self.failed)
            if windows.get(group_of(key)) is None
        ]
        return min((p for p in positions if p is not None), default=math.inf)


class TenantNames:
    """The tenant's name of each request about to start: its vLLM ``cache_salt`` (``name``,
    from the connector's ``on_new_request``), else the engine's ``namespace``."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._salts: dict[str, str] = {}

    def name(self, req_id: str, cache_salt: str | None) -> None:
        if cache_salt:
            self._salts[req_id] = cache_salt

    def take(self, req_id: str) -> str:
        """The request's tenant (once: the request is starting)."""
        return self._salts.pop(req_id, "") or self.namespace


def lookup_queued(
    state: EngineRequest,
    link: ServiceLink,
    ask: Callable[[KVOffloadClient, list[list[bytes]]], list[LookupOutcome]],
    windows: Mapping[int, int | None],
    stats: StatsAccumulator,
    after_call: Callable[[], None],
) -> None:
    """Ask the service for the request's queued keys, group by group (``lookups``), through
    ``ask`` (a pinned lookup) over ``link``; ``after_call`` runs after each call, before its
    answers are recorded (the link may have reconnected). Keys the service could not be asked
    (it is down) are MISS for the request."""
    queued = list(state.queued)
    state.queued.clear()
    if all(key in state.pinned or key in state.landing for key in queued):
        return  # every key is answered without asking: the search would learn nothing
    unanswered = dict.fromkeys(queued)
    # The request's pinned keys take part as HITs, so a sliding window that holds one of them
    # is found without asking below it; like keys whose landing will be told (HIT_PENDING),
    # they are answered without asking.
    keys = queued + [key for key in state.pinned if key not in unanswered]

    def answer(
        batch: list[bytes], known: dict[bytes, LookupResult], told: list[LookupResult]
    ) -> list[LookupResult]:
        """``batch``'s answers: the ``known`` keys' and, in order, the service's (``told``)."""
        if not known:
            results = list(told[: len(batch)])
            for key in batch[: len(results)]:
                unanswered.pop(key, None)
            return results
        answers = iter(told)
        results = []
        for key in batch:
            result = known[key] if key in known else next(answers, None)
            if result is None:
                break  # the service's answer ended (after a MISS)
            results.append(result)
        for key in batch[: len(results)]:
            unanswered.pop(key, None)
        return results

    def call(batches: list[list[bytes]]) -> list[list[LookupResult]]:
        known = {
            key: LookupResult.HIT if key in state.pinned else LookupResult.HIT_PENDING
            for batch in batches
            for key in batch
            if key in state.pinned or key in state.landing
        }
        asked = [[key for key in batch if key not in known] for batch in batches]
        sent = [keys for keys in asked if keys]
        outcomes = iter(link.call(lambda client: ask(client, sent)) if sent else [])
        if sent:
            after_call()
        return [
            answer(batch, known, record_lookup(state, keys, next(outcomes), stats) if keys else [])
            for batch, keys in zip(batches, asked, strict=True)
        ]

    try:
        not_asked = ask_by_group(
            keys, group_of, state.position, windows, call, state.full_miss_position(windows)
        )
    except (ServiceDown, KVOffloadError) as exc:
        log.debug("kvoffload_lookup_failed req_id=%s error=%s", state.ctx.req_id, exc)
        state.missed.update(unanswered)
        state.uncertain.clear()
        stats.add(Counter.MISS_BLOCKS, len(unanswered))
        return
    for key in not_asked:
        if key in unanswered:
            state.missed.add(key)
            state.uncertain.pop(key, None)
    stats.add(Counter.MISS_BLOCKS, len(not_asked.intersection(unanswered)))


def record_lookup(
    state: EngineRequest, keys: list[bytes], outcome: LookupOutcome, stats: StatsAccumulator
) -> list[LookupResult]:
    """Record the service's answers for ``keys`` (a prefix of them: up to the first MISS);
    every HIT is pinned for this engine. Returns the answers."""
    if len(outcome.slots) != len(outcome.raw_results):
        log.error(
            "kvoffload_lookup_without_pins req_id=%s: the service ignored pin", state.ctx.req_id
        )
        state.missed.update(keys)
        return [LookupResult.MISS] * len(keys)
    if (
        outcome.ready_prefix == len(outcome.raw_results) == len(keys) == len(outcome.checksums)
        and not outcome.landing_slots
        and not state.uncertain
        and not state.promoted
    ):  # every key a HIT found in the pool (a whole prefix found there): pin them at once
        state.pinned.update(
            zip(keys, zip(outcome.slots, outcome.checksums, strict=True), strict=True)
        )
        stats.add(Counter.HIT_BLOCKS, len(keys), "host")
        return [LookupResult.HIT] * len(keys)
    results = [_VLLM_RESULT[code] for code in outcome.raw_results]
    for key, slot in zip(keys, outcome.landing_slots, strict=False):
        if slot >= 0:
            state.landing[key] = outcome.ticket
    hits = Multiset[str]()
    misses = 0
    for i, (key, result) in enumerate(zip(keys, results, strict=False)):
        if result is LookupResult.HIT:
            digests = outcome.checksums[i] if i < len(outcome.checksums) else []
            state.pinned[key] = (outcome.slots[i], digests)
            if key in state.uncertain:
                state.promoted.add(key)
                del state.uncertain[key]
            hits["secondary" if key in state.promoted else "host"] += 1
        elif result is LookupResult.MISS:
            state.missed.add(key)
            state.uncertain.pop(key, None)
            misses += 1
        else:
            state.uncertain[key] = result
    for tier, count in hits.items():
        stats.add(Counter.HIT_BLOCKS, count, tier)
    stats.add(Counter.MISS_BLOCKS, misses)
    return results
