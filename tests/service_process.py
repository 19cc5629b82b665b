"""The process-level tests' service: ``kvoffload serve`` run by the one ``ServiceHarness``
(``Launch.SERVE``); the ``start_service`` fixture is registered in tests/conftest.py. Also the
helpers that scrape the metrics endpoint."""

from __future__ import annotations

import time
import tomllib
from pathlib import Path

import pytest

from kvoffload.soak.service import Launch, ServiceHarness

TEST_DEFAULTS = {
    "service": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 3.0, "log_level": "info"},
    "pool": {"num_slots": 64, "block_bytes": 65536},
    "disk": {"enabled": False, "capacity_bytes": 67108864},
    "supervisor": {"restart_backoff_initial_s": 0.2, "drain_timeout_s": 5.0},
}


def serve_harness(
    home: Path,
    workers=("cpu",),
    extra_config: str = "",
    service_options: str = "",
    num_slots: int = 64,
    block_bytes: int = 65536,
) -> ServiceHarness:
    """A (not yet started) ``kvoffload serve`` with ``workers``. ``service_options``: extra
    ``key = value`` lines of the [service] table; ``extra_config``: TOML whose leading keys
    belong to [supervisor], then any tables (``[faults]``, ``[object]``, ``[[engines]]``)."""
    sections = tomllib.loads(f"[service]\n{service_options}\n[supervisor]\n{extra_config}\n")
    sections["pool"] = {"num_slots": num_slots, "block_bytes": block_bytes}
    sections.setdefault("disk", {})["enabled"] = "disk" in workers
    return ServiceHarness(home, sections, defaults=TEST_DEFAULTS, launch=Launch.SERVE)


@pytest.fixture
def start_service(tmp_path):
    """``start(**serve_harness options)`` -> a started service; each is stopped at the end and
    must leave no segment, runtime file or process behind."""
    started: list[ServiceHarness] = []

    def start(**kw) -> ServiceHarness:
        home = tmp_path / f"svc{len(started)}"
        service = serve_harness(home, **kw)
        started.append(service)
        return service.start()

    yield start
    leftovers = [service.stop() for service in started]
    dirty = [left for left in leftovers if not left.clean]
    assert not dirty, f"runs left things behind: {dirty}"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_metrics(port: int, ready=lambda families: True, timeout_s: float = 10.0) -> dict:
    """The manager's metrics endpoint parsed by prometheus_client: {family name: family}, once
    ``ready(families)`` holds (TimeoutError with the last text otherwise)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

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
    families: dict, family: str, sample: str | None = None, **labels: str
) -> float | None:
    """The value of the one sample of ``family`` named ``sample`` (default: the family's own
    counter or gauge sample) with exactly these labels (histograms: plus ``le`` for buckets)."""
    for s in families[family].samples if family in families else ():
        if s.name == (sample or _own_sample(families[family])) and s.labels == labels:
            return s.value
    return None


def _own_sample(family) -> str:
    return family.name + "_total" if family.type == "counter" else family.name
