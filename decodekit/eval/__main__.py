"""``python -m decodekit.eval [flags]``: the same as ``decodekit eval [flags]``."""

import sys

from decodekit.cli import main

sys.exit(main(["eval", *sys.argv[1:]]))
