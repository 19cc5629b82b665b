"""Runs the store-burst benchmark (``kvoffload.bench.burst``): a burst larger than the host pool,
write-back to the disk tier, and every acknowledged block brought back."""

from kvoffload.bench.burst import main

if __name__ == "__main__":
    raise SystemExit(main())
