"""`kvoffload bench --quick` against the committed baseline; exit 1 on a cell that dropped by more than 15%."""

from kvoffload.bench.regressions import main

if __name__ == "__main__":
    raise SystemExit(main())
