"""The integration's settings, read from vLLM's ``kv_connector_extra_config``.

| key | default | meaning |
|---|---|---|
| ``endpoint`` | ``KVOFFLOAD_ENDPOINT``, else the local run | client endpoint of the service |
| ``call_timeout_s`` | 0.5 | bound of one call; then the service counts as down |
| ``connect_timeout_s`` | 0.5 | bound of one connection attempt |
| ``max_backoff_s`` | 2.0 | longest wait between reconnection attempts |
| ``namespace`` | ``""`` | extra text in the key fingerprint (keeps deployments apart); also the tenant of the engine's requests without a ``cache_salt`` (docs/tenants.md) |
| ``model_revision`` | vLLM's revision | revision in the key fingerprint |
| ``verify_loads`` | true | check each loaded block against the checksum taken when written |
| ``faults`` | none | kvoffload fault spec for the worker side (``fail_fraction`` of loads) |
| ``fault_ranks`` | every rank | the tensor-parallel ranks whose workers apply ``faults`` |
| ``layered_load_cpus`` | the process's CPUs its worker thread is not bound to | CPUs that copy synchronous loads layer by layer beside the forward (vLLM on CPU); ``[]``: no layered loads |
| ``idle_landing_wait_ms`` | 5 | longest an otherwise idle engine waits, in one step, for the blocks a request's lookup promoted to land (a request that arrives meanwhile waits as long at most) |
| ``sync_load_budget_bytes`` | 256 MiB, 0 with several KV cache groups | KV bytes per step and worker of pool hits loaded in the step that schedules them (set by the connector, read by vLLM 0.33 or ``sync_loads``) |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvoffload.wire.protocol import FaultSpec

IDLE_LANDING_WAIT_MS = 5
"""The default ``idle_landing_wait_ms``: the longest an idle engine waits in one step for the
blocks a request's lookup promoted to land (a request that arrives meanwhile waits as long at
most)."""


@dataclass(frozen=True)
class ConnectorSettings:
    endpoint: str = ""
    call_timeout_s: float = 0.5
    connect_timeout_s: float = 0.5
    max_backoff_s: float = 2.0
    namespace: str = ""
    model_revision: str = ""
    verify_loads: bool = True
    faults: FaultSpec | None = None
    fault_ranks: tuple[int, ...] | None = None
    layered_load_cpus: frozenset[int] | None = None
    idle_landing_wait_ms: int = IDLE_LANDING_WAIT_MS

    def faults_for(self, rank: int) -> FaultSpec | None:
        """The faults the worker of ``rank`` injects."""
        return self.faults if self.fault_ranks is None or rank in self.fault_ranks else None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        """ValueError naming the key for a value of the wrong type or range."""
        out: dict[str, Any] = {}
        for name in ("endpoint", "namespace", "model_revision"):
            if name in extra:
                if not isinstance(extra[name], str):
                    raise ValueError(f"kv_connector_extra_config[{name!r}] must be a string")
                out[name] = extra[name]
        for name in ("call_timeout_s", "connect_timeout_s", "max_backoff_s"):
            if name in extra:
                value = extra[name]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise ValueError(
                        f"kv_connector_extra_config[{name!r}] must be a positive number, "
                        f"got {value!r}"
                    )
                out[name] = float(value)
        if "verify_loads" in extra:
            if not isinstance(extra["verify_loads"], bool):
                raise ValueError("kv_connector_extra_config['verify_loads'] must be true or false")
            out["verify_loads"] = extra["verify_loads"]
        wait = extra.get("idle_landing_wait_ms")
        if wait is not None:
            if isinstance(wait, bool) or not isinstance(wait, int) or wait < 0:
                raise ValueError(
                    "kv_connector_extra_config['idle_landing_wait_ms'] must be a non-negative "
                    f"integer, got {wait!r}"
                )
            out["idle_landing_wait_ms"] = wait
        budget = extra.get("sync_load_budget_bytes")
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < 0
        ):
            raise ValueError(
                "kv_connector_extra_config['sync_load_budget_bytes'] must be a non-negative "
                f"integer, got {budget!r}"
            )
        if extra.get("faults") is not None:
            try:
                out["faults"] = msgspec.convert(extra["faults"], FaultSpec)
            except msgspec.ValidationError as exc:
                raise ValueError(f"kv_connector_extra_config['faults']: {exc}") from None
        ranks = _numbers(extra, "fault_ranks", "rank")
        if ranks is not None:
            out["fault_ranks"] = tuple(ranks)
        cpus = _numbers(extra, "layered_load_cpus", "CPU")
        if cpus is not None:
            out["layered_load_cpus"] = frozenset(cpus)
        return cls(**out)


def _numbers(extra: Mapping[str, Any], name: str, what: str) -> list[int] | None:
    """``extra[name]`` checked to be a list of non-negative integers (``what`` numbers); None
    when absent. ValueError naming the key otherwise."""
    value = extra.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    ):
        raise ValueError(
            f"kv_connector_extra_config[{name!r}] must be a list of {what} numbers, got {value!r}"
        )
    return value
