"""Start the decodekit demo: ``python demo/app.py [--port 7860]`` (the same as ``decodekit demo``)."""

from decodekit.demo.app import main

if __name__ == "__main__":
    raise SystemExit(main())
