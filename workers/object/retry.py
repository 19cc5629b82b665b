"""Bounded, jittered exponential backoff between attempts of one request."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Up to ``max_retries`` extra attempts; before retry n (0-based) wait a delay drawn from
    ``[d/2, d]`` with ``d = min(max_delay_s, base_delay_s * 2**n)``."""

    max_retries: int = 3
    base_delay_s: float = 0.05
    max_delay_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ValueError(f"invalid retry policy {self}")

    def delay(self, retry_index: int, rand: float | None = None) -> float:
        ceiling = min(self.max_delay_s, self.base_delay_s * (2**retry_index))
        jitter = random.random() if rand is None else rand
        return ceiling / 2 + jitter * ceiling / 2
