"""Runs the events-cost benchmark (``kvoffload.bench.events``): the manager's lookup and store
throughput with 16 clients, with the tiers' events off and on."""

from kvoffload.bench.events import main

if __name__ == "__main__":
    raise SystemExit(main())
