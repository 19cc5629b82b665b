"""The manager's Prometheus endpoint as tests read it: scraped and parsed by prometheus_client."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def scrape_metrics(
    port: int,
    ready: Callable[[dict[str, Any]], bool] = lambda families: True,
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    """The manager's metrics endpoint parsed by prometheus_client: {family name: family}, once
    ``ready(families)`` holds (TimeoutError with the last text otherwise)."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while True:
        try:
            text = (
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
                .read()
                .decode()
            )
            families = {f.name: f for f in text_string_to_metric_families(text)}
            if ready(families):
                return families
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"metrics not ready:\n{text[-3000:]}")
        time.sleep(0.1)


def sample_value(
    families: dict[str, Any], family: str, sample: str | None = None, **labels: str
) -> float | None:
    """The value of the one sample of ``family`` named ``sample`` (default: the family's own
    counter or gauge sample) with exactly these labels (histograms: plus ``le`` for buckets)."""
    for s in families[family].samples if family in families else ():
        if s.name == (sample or _own_sample(families[family])) and s.labels == labels:
            return s.value
    return None


def _own_sample(family: Any) -> str:
    return family.name + "_total" if family.type == "counter" else family.name
