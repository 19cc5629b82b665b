"""Soak run: ``python scripts/soak.py --duration 120 [--seed N] [--clients K] [--s3] [--json-out F]``.

The same as ``kvoffload soak``; see ``kvoffload.soak.runner``. Exits 1 on any invariant violation.
"""

import sys

from kvoffload.soak.runner import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
