"""The per-request loop of the reference engine: reuse a prefix through kvoffload, compute the
rest, offload what was computed, decode greedily.

For one prompt (with a client):
1. ``new_request``; look up the keys of the prompt's full blocks (all but the block holding the
   last prompt token's position when the prompt ends on a block boundary: at least one token is
   always computed, it yields the first logits). While the reply says wait (HIT_PENDING/RETRY),
   ``end_step`` (which submits promotions) and look up again, for at most ``wait_budget_s``.
2. Load the ready (HIT) prefix into fresh cache blocks and wait for the load job; a partial
   failure keeps the successfully loaded leading blocks.
3. Prefill the remaining prompt tokens in chunks on top of the loaded K/V; the argmax of the last
   logits is the first token (TTFT stops here).
4. Offload the prompt's newly computed full blocks (asynchronously), decode the other tokens
   greedily, offload the blocks that decoding filled, wait for the store jobs, finish the request.

Without a client every prompt is a full recompute (the reference run).
Which tier served the reused blocks: the leading HITs of the first lookup came from the host
pool; blocks that became ready while waiting were promoted from a secondary tier, attributed from
the service's per-tier ``promoted_keys_ok`` counters.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from kvoffload.client import KVOffloadClient, LookupOutcome
from kvoffload.engine.hashing import block_keys
from kvoffload.engine.model import TinyDecoder
from kvoffload.engine.paged_cache import PagedKVCache
from kvoffload.logs import get_logger

log = get_logger()

POOL_TIER = "pool"
PROMOTED_TIER = "secondary"


@dataclass
class Generation:
    """The outcome of one prompt. ``logits[i]`` produced ``tokens[i]``. ``loaded``/``stored``
    map block keys to the digest of the block's bytes as loaded / as computed and offloaded.
    ``block_table`` is empty unless the request ran with ``keep_kv``."""

    req_id: str
    prompt_tokens: int
    tokens: list[int]
    logits: torch.Tensor
    ttft_s: float
    total_s: float
    reused_blocks: int = 0
    computed_tokens: int = 0
    served_by: Counter = field(default_factory=Counter)
    lookup_rounds: int = 0
    loaded: dict[bytes, bytes] = field(default_factory=dict)
    stored: dict[bytes, bytes] = field(default_factory=dict)
    store_failures: int = 0
    block_table: list[int] = field(default_factory=list)

    def to_dict(self, with_logits: bool = False) -> dict:
        """JSON-ready summary (keys and digests in hex; logits as exact float lists)."""
        out = {
            "req_id": self.req_id,
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens,
            "ttft_s": self.ttft_s,
            "total_s": self.total_s,
            "reused_blocks": self.reused_blocks,
            "computed_tokens": self.computed_tokens,
            "served_by": dict(self.served_by),
            "lookup_rounds": self.lookup_rounds,
            "loaded": {k.hex(): d.hex() for k, d in self.loaded.items()},
            "stored": {k.hex(): d.hex() for k, d in self.stored.items()},
            "store_failures": self.store_failures,
        }
        if with_logits:
            out["logits"] = self.logits.tolist()
        return out


class Engine:
    """One model, one paged KV cache and optionally one kvoffload client (not thread-safe)."""

    def __init__(
        self,
        model: TinyDecoder,
        cache: PagedKVCache,
        client: KVOffloadClient | None = None,
        name: str = "engine",
        prefill_chunk: int = 1024,
        wait_budget_s: float = 30.0,
    ) -> None:
        self.model = model
        self.cfg = model.cfg
        self.cache = cache
        self.client = client
        self.name = name
        self.prefill_chunk = prefill_chunk
        self.wait_budget_s = wait_budget_s
        self.handle_id = f"{name}-kv"
        self._req_ids = itertools.count(1)
        if client is not None:
            if client.info.block_bytes != self.cfg.block_bytes:
                raise ValueError(
                    f"the service's pool.block_bytes is {client.info.block_bytes}, this model's blocks "
                    f"are {self.cfg.block_bytes} bytes"
                )
            client.register_kv(cache.handle(self.handle_id))

    @classmethod
    def connect(cls, model: TinyDecoder, endpoint: str, num_blocks: int, name: str, **kw) -> Engine:
        """An engine with a shared-memory cache registered with the service at ``endpoint``."""
        cache = PagedKVCache.shared(model.cfg, num_blocks)
        try:
            client = KVOffloadClient(endpoint, timeout_s=60.0, name=name)
        except BaseException:
            cache.close()
            raise
        try:
            return cls(model, cache, client, name, **kw)
        except BaseException:
            client.close()
            cache.close()
            raise

    @classmethod
    def local(cls, model: TinyDecoder, num_blocks: int, **kw) -> Engine:
        """An engine without the service: every prompt is computed in full."""
        return cls(model, PagedKVCache.local(model.cfg, num_blocks), None, "local", **kw)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.cache.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def keys(self, tokens: list[int]) -> list[bytes]:
        """Keys of the full blocks of ``tokens`` for this model."""
        return block_keys(tokens, self.cfg.block_tokens, self.model.model_id)

    # ---- one request ----------------------------------------------------------------------

    def generate(self, prompt: list[int], max_new_tokens: int, keep_kv: bool = False) -> Generation:
        """Greedy-decode ``max_new_tokens`` (>= 1) tokens after ``prompt`` (non-empty). With
        ``keep_kv`` the request's cache blocks stay allocated (``free(result.block_table)``)."""
        if not prompt or max_new_tokens < 1:
            raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
        bt = self.cfg.block_tokens
        req_id = f"{self.name}-{next(self._req_ids)}"
        # Read before the lookup that may start promotions: blocks can land before it returns.
        promoted_before = self._promoted_per_tier() if self.client is not None else None
        started = time.perf_counter()
        table = self.cache.allocate(-(-(len(prompt) + max_new_tokens - 1) // bt))
        result = Generation(req_id, len(prompt), [], torch.empty(0), 0.0, 0.0)
        jobs: dict[int, list[bytes]] = {}
        try:
            if self.client is not None:
                request_level = self.client.new_request(req_id)
                prompt_keys = self.keys(prompt)
                reused, from_pool = self._reuse_prefix(
                    req_id, prompt_keys[: (len(prompt) - 1) // bt], table, result
                )
            else:
                request_level, prompt_keys, reused = False, [], 0
            first = reused * bt
            logits = self.prefill(prompt, first, table)
            result.tokens.append(int(logits.argmax()))
            result.ttft_s = time.perf_counter() - started
            result.computed_tokens = len(prompt) - first
            result.loaded = {
                k: self.cache.block_digest(b)
                for k, b in zip(prompt_keys[:reused], table[:reused], strict=True)
            }
            if self.client is not None:
                result.served_by = self._attribute(min(from_pool, reused), reused, promoted_before)
                self._offload(
                    req_id, prompt_keys, 0 if request_level else reused, table, result, jobs
                )
            tokens, steps = self.decode(prompt, result.tokens[0], table, max_new_tokens - 1)
            result.tokens.extend(tokens)
            result.logits = torch.stack([logits, *steps])
            if self.client is not None:
                decoded_keys = self.keys(prompt + result.tokens[:-1])
                self._offload(req_id, decoded_keys, len(prompt_keys), table, result, jobs)
                self._wait_stores(jobs, result)
                self.client.finish_request(req_id)
        except BaseException:
            if self.client is not None:
                self._abandon(req_id, jobs, result)
            raise
        finally:
            if not keep_kv:
                self.cache.free(table)
        if keep_kv:
            result.block_table = table
        result.total_s = time.perf_counter() - started
        log.debug(
            "request_done",
            req_id=req_id,
            prompt=len(prompt),
            reused_blocks=result.reused_blocks,
            ttft_ms=round(result.ttft_s * 1000, 3),
            served_by=dict(result.served_by),
        )
        return result

    def free(self, block_table: list[int]) -> None:
        self.cache.free(block_table)

    def prefill(self, prompt: list[int], start: int, table: list[int]) -> torch.Tensor:
        """Compute ``prompt[start:]`` (non-empty) in chunks of ``prefill_chunk`` on top of the
        K/V of positions ``< start`` in ``table``; returns the last position's logits."""
        tokens = torch.tensor(prompt, dtype=torch.int64)
        logits: torch.Tensor | None = None
        for begin in range(start, len(prompt), self.prefill_chunk):
            end = min(begin + self.prefill_chunk, len(prompt))
            logits = self.model(tokens[begin:end], begin, self.cache, table)
        if logits is None:
            raise ValueError(f"nothing to prefill: start {start} of {len(prompt)} tokens")
        return logits

    def decode(
        self, sequence: list[int], token: int, table: list[int], steps: int
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding after ``sequence`` (whose K/V is in ``table``) and its next ``token``:
        ``steps`` more tokens and the logits that chose each."""
        tokens: list[int] = []
        logits_per_step: list[torch.Tensor] = []
        position = len(sequence)
        for _ in range(steps):
            logits = self.model(torch.tensor([token]), position, self.cache, table)
            token = int(logits.argmax())
            tokens.append(token)
            logits_per_step.append(logits)
            position += 1
        return tokens, logits_per_step

    # ---- kvoffload ------------------------------------------------------------------------

    @property
    def _client(self) -> KVOffloadClient:
        """The client, for the helpers below (``generate`` calls them only when it has one)."""
        if self.client is None:
            raise RuntimeError(f"engine {self.name} has no kvoffload client")
        return self.client

    def _reuse_prefix(
        self, req_id: str, keys: list[bytes], table: list[int], result: Generation
    ) -> tuple[int, int]:
        """Look up, wait for promotions, load the ready prefix. Returns the blocks reused and
        the blocks ready at the first lookup (host pool)."""
        if not keys:
            return 0, 0
        outcome = self._client.lookup(req_id, keys)
        from_pool = outcome.ready_prefix
        outcome, rounds = self._wait_lookup(req_id, keys, outcome)
        result.lookup_rounds = rounds
        ready = min(outcome.ready_prefix, len(keys))
        if not ready:
            return 0, 0
        job_id = self._client.load(req_id, keys[:ready], table[:ready], self.handle_id).job_id
        if job_id is None:
            raise RuntimeError(f"a load of {ready} keys was accepted without a job")
        done = self._client.wait([job_id], timeout_s=60.0)[job_id]
        if done.success:
            reused = ready
        else:
            ok = set(done.successful_keys or ())
            reused = next((i for i, k in enumerate(keys[:ready]) if k not in ok), ready)
            log.warning(
                "load_partly_failed", req_id=req_id, asked=ready, reused=reused, error=done.error
            )
        result.reused_blocks = reused
        return reused, from_pool

    def _wait_lookup(
        self, req_id: str, keys: list[bytes], outcome: LookupOutcome
    ) -> tuple[LookupOutcome, int]:
        rounds = 1
        deadline = time.monotonic() + self.wait_budget_s
        while outcome.must_wait and time.monotonic() < deadline:
            self._client.end_step()
            time.sleep(0.001)
            outcome = self._client.lookup(req_id, keys)
            rounds += 1
        if outcome.must_wait:
            log.warning(
                "lookup_wait_budget_spent", req_id=req_id, rounds=rounds, ready=outcome.ready_prefix
            )
        return outcome, rounds

    def _promoted_per_tier(self) -> Counter:
        per_tier = self._client.status().tiering.per_tier
        return Counter(
            {name: c.promoted_keys_ok for name, c in per_tier.items() if name != "primary"}
        )

    def _attribute(self, from_pool: int, reused: int, promoted_before: Counter | None) -> Counter:
        served = Counter({POOL_TIER: from_pool} if from_pool else {})
        promoted = reused - from_pool
        if promoted <= 0:
            return served
        delta = self._promoted_per_tier() - (promoted_before or Counter())
        if sum(delta.values()) >= promoted:
            for tier, count in delta.most_common():
                take = min(count, promoted)
                served[tier] += take
                promoted -= take
        if promoted:
            served[PROMOTED_TIER] += promoted
        return served

    def _offload(
        self,
        req_id: str,
        keys: list[bytes],
        first: int,
        table: list[int],
        result: Generation,
        jobs: dict,
    ) -> None:
        """Submit a store of blocks ``first..len(keys)-1`` (their K/V is complete)."""
        if first >= len(keys):
            return
        blocks = table[first : len(keys)]
        digests = {k: self.cache.block_digest(b) for k, b in zip(keys[first:], blocks, strict=True)}
        accepted = self._client.store(req_id, keys[first:], blocks, self.handle_id)
        if accepted.job_id is not None:
            jobs[accepted.job_id] = list(accepted.keys)
            result.stored.update((k, digests[k]) for k in accepted.keys)

    def _abandon(self, req_id: str, jobs: dict[int, list[bytes]], result: Generation) -> None:
        """After a failure mid-request: let submitted stores finish reading the blocks (they are
        freed next), then finish the request. Best effort; errors are logged."""
        try:
            if jobs:
                self._wait_stores(jobs, result)
            self._client.finish_request(req_id)
        except Exception as exc:  # noqa: BLE001 - abandoning is best effort
            log.error("request_abandon_failed", req_id=req_id, error=repr(exc))

    def _wait_stores(self, jobs: dict[int, list[bytes]], result: Generation) -> None:
        done = self._client.wait(list(jobs), timeout_s=60.0)
        for job_id, event in done.items():
            if not event.success:
                ok = set(event.successful_keys or ())
                failed = [k for k in jobs[job_id] if k not in ok]
                result.store_failures += len(failed)
                for k in failed:
                    result.stored.pop(k, None)
        jobs.clear()
