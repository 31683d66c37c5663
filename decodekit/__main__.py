"""``python -m decodekit``: the same as the ``decodekit`` command."""

import sys

from decodekit.cli import main

sys.exit(main())
