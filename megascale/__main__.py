"""`python -m megascale` is `megascale` (torchrun launches modules this way)."""

import sys

from megascale.cli import main

sys.exit(main())
