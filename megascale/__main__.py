"""`python -m megascale` is `megascale` (torchrun launches modules this way)."""

import sys

from megascale.cli import main

if __name__ == "__main__":  # not when a spawned child (the checkpoint writer) imports its parent's main
    sys.exit(main())
