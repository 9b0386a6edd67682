"""``python -m commfuse.bench``: the same as ``commfuse bench`` (and what ``--link-rate`` re-executes)."""

import sys

from commfuse.bench.command import main

if __name__ == "__main__":
    sys.exit(main())
