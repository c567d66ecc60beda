"""``python -m lucid_fx``: the same command line as ``lucid-fx``."""

import sys

from lucid_fx.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m lucid_fx"))
