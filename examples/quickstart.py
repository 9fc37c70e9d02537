"""Quickstart: run the seed recipe on a generated corpus with a locally trained tokenizer.

    python examples/quickstart.py [--lanes 4] [--workers 0]

Prints batch shapes, throughput, and an exact checkpoint/resume check. Needs no downloads.
"""

import sys

from zephon.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
