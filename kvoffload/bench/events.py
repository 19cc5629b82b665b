"""What the tiers' events cost the manager: its lookup and store throughput with many clients,
with events off and on, in alternating rounds of one run.

Each client is a process of its own that repeats one request: a lookup of ``--lookup-keys``
keys, a store of ``--store-keys`` new keys (prepared and completed, no bytes copied) and the
request's end. "On" (``--events both``): the node stream is configured (a PUB with a subscriber
that reads it) and one more client takes the events every 50 ms, as a vLLM engine with KV events
does; ``stream`` or ``feed`` turns on one of the two. Writes one JSON document: requests per
second per round and the median cost.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from kvoffload.client import KVOffloadClient
from kvoffload.testing.service import ServiceHarness


def _client(endpoint: str, n: int, args: dict[str, Any], start: float, out: Any) -> None:
    client = KVOffloadClient(endpoint, timeout_s=30, name=f"bench-{n}")
    lookups = [f"warm-{i}".encode().ljust(32, b".") for i in range(args["lookup_keys"])]
    ops = 0
    i = 0
    while time.monotonic() < start:
        time.sleep(0.001)
    deadline = start + args["seconds"]
    while time.monotonic() < deadline:
        req = f"r{n}-{i}"
        client.new_request(req)
        client.lookup(req, lookups)
        keys = [f"{n}-{i}-{k}".encode().ljust(32, b".") for k in range(args["store_keys"])]
        prepared = client.prepare_store(req, keys)
        client.complete_store(req, prepared.keys)
        client.finish_request(req)
        ops += 1
        i += 1
    client.close()
    out.put(ops)


def _round(endpoint: str, args: dict[str, Any], events: bool) -> float:
    """Requests per second of all clients together in one round (``events``: with a client
    that takes the events)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    start = time.monotonic() + 3.0
    procs = [
        ctx.Process(target=_client, args=(endpoint, n, args, start, results))
        for n in range(args["clients"])
    ]
    for proc in procs:
        proc.start()
    stop = threading.Event()
    taker = threading.Thread(target=_take_events, args=(endpoint, stop)) if events else None
    if taker is not None:
        taker.start()
    total = sum(results.get(timeout=args["seconds"] + 60) for _ in procs)
    for proc in procs:
        proc.join()
    stop.set()
    if taker is not None:
        taker.join()
    return total / args["seconds"]


def _take_events(endpoint: str, stop: threading.Event) -> None:
    client = KVOffloadClient(endpoint, timeout_s=30, name="events")
    cursor = 0
    while not stop.wait(0.05):
        reply = client.take_tier_events(cursor)
        cursor = reply.cursor
        while reply.more:
            reply = client.take_tier_events(cursor)
            cursor = reply.cursor
    client.close()


def _subscribe(endpoint: str, stop: threading.Event, counts: list[int]) -> None:
    zctx = zmq.Context()
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    while not stop.is_set():
        if sub.poll(100):
            sub.recv_multipart()
            counts[0] += 1
    zctx.destroy(linger=0)


def _service(workdir: Path, events_endpoint: str, num_slots: int) -> ServiceHarness:
    sections: dict[str, Any] = {
        "service": {"log_level": "warning"},
        "pool": {"block_bytes": 4096, "num_slots": num_slots, "slot_headers": False},
        "disk": {"enabled": False},
        "events": {"endpoint": events_endpoint},
    }
    return ServiceHarness(workdir, sections, defaults={}, watch=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lookup-keys", type=int, default=64)
    parser.add_argument("--store-keys", type=int, default=8)
    parser.add_argument("--num-slots", type=int, default=4096)
    parser.add_argument("--events", choices=("both", "stream", "feed"), default="both")
    parser.add_argument("--out", default="bench-events.json")
    args = vars(parser.parse_args(argv))
    rounds: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="kvoffload-bench-events-") as tmp:
        for r in range(args["rounds"]):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                home = Path(tmp) / f"{mode}-{r}"
                home.mkdir()
                streaming = mode == "on" and args["events"] in ("both", "stream")
                taking = mode == "on" and args["events"] in ("both", "feed")
                endpoint = f"ipc://{home}/events.sock" if streaming else ""
                service = _service(home, endpoint, args["num_slots"]).start()
                stop = threading.Event()
                counts = [0]
                sub = threading.Thread(target=_subscribe, args=(endpoint, stop, counts))
                if streaming:
                    sub.start()
                try:
                    rounds[mode].append(_round(service.endpoint, args, events=taking))
                finally:
                    stop.set()
                    if streaming:
                        sub.join()
                    service.stop()
                print(f"round {r} events {mode}: {rounds[mode][-1]:.0f} requests/s", flush=True)
    off, on = statistics.median(rounds["off"]), statistics.median(rounds["on"])
    result = {
        "clients": args["clients"],
        "events": args["events"],
        "lookup_keys": args["lookup_keys"],
        "store_keys": args["store_keys"],
        "seconds": args["seconds"],
        "requests_per_s": rounds,
        "median_off": off,
        "median_on": on,
        "cost": 1 - on / off,
    }
    Path(args["out"]).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0
