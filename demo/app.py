"""Start the decodekit demo: ``python demo/app.py [--port 7860]`` (the same as ``decodekit demo``)."""

import sys

from decodekit.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["demo", *sys.argv[1:]]))
