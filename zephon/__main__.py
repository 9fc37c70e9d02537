"""``python -m zephon``: the command line (see :mod:`zephon.cli.main`)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
