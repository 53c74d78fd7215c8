"""``python -m torchtp``: the same command line as the ``torchtp`` script."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
