"""Where the time of one data-path operation goes, per process; same as `python -m kvoffload.bench.profile`."""

from kvoffload.bench.profile import main

if __name__ == "__main__":
    raise SystemExit(main())
