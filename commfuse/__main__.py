import sys

from commfuse.cli import main

sys.exit(main())
