"""``python -m commfuse.sim ...``: the same as ``commfuse simulate ...``."""

import sys

from commfuse.cli import main

if __name__ == "__main__":
    sys.exit(main(["simulate", *sys.argv[1:]]))
