"""scripts/setup.sh's choice of torch build, checked on the commands it would run (no network)."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import threading
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parent.parent / "scripts" / "setup.sh"


@pytest.fixture
def reachable_index(tmp_path):
    """A local wheel index that answers for torch."""
    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<html></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def _dry_run(tmp_path: Path, index_url: str, *, gpu: bool, **env: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "nvidia-smi"
    if gpu:
        fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100'\n")
        fake.chmod(0o755)
    elif fake.exists():
        fake.unlink()
    path = os.pathsep.join([str(bin_dir), *(p for p in os.environ["PATH"].split(os.pathsep) if "nvidia" not in p)])
    environment = {**os.environ, "PATH": path, "DECODEKIT_SETUP_DRY_RUN": "1", "DECODEKIT_CPU_INDEX_URL": index_url}
    environment.pop("TORCH_SPEC", None)
    environment.pop("TORCH_INDEX_URL", None)
    environment.update(env)
    result = subprocess.run(
        ["bash", str(SETUP), str(tmp_path / "venv")], capture_output=True, text=True, env=environment, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _torch_command(output: str) -> str:
    return next(
        line
        for line in output.splitlines()
        if line.startswith("would run") and (" torch=" in line or " torch>" in line)
    )


def test_without_a_gpu_the_cpu_index_comes_first(tmp_path, reachable_index):
    output = _dry_run(tmp_path, reachable_index, gpu=False)
    assert _torch_command(output).endswith(f"install --quiet --index-url {reachable_index} torch==2.13.0")
    assert f"torch: torch==2.13.0, CPU build from {reachable_index}" in output


def test_without_a_gpu_and_no_cpu_index_it_falls_back_to_the_default_index_and_says_so(tmp_path):
    unreachable = "http://127.0.0.1:9/"  # the discard port: nothing answers
    output = _dry_run(tmp_path, unreachable, gpu=False)
    assert _torch_command(output).endswith("install --quiet torch==2.13.0")
    assert f"from the default index: {unreachable} cannot be reached" in output


def test_with_a_gpu_it_takes_the_default_cuda_build(tmp_path, reachable_index):
    output = _dry_run(tmp_path, reachable_index, gpu=True)
    assert _torch_command(output).endswith("install --quiet torch>=2.6")
    assert "CUDA build (an NVIDIA GPU is present)" in output


def test_torch_spec_and_index_override_the_choice(tmp_path, reachable_index):
    output = _dry_run(tmp_path, reachable_index, gpu=False, TORCH_SPEC="torch==2.12.0", TORCH_INDEX_URL="http://x/")
    assert _torch_command(output).endswith("install --quiet --index-url http://x/ torch==2.12.0")


def test_every_step_is_one_line(tmp_path, reachable_index):
    output = _dry_run(tmp_path, reachable_index, gpu=False)
    steps = [line for line in output.splitlines() if line.startswith("decodekit setup:")]
    assert len(steps) >= 5 and all(len(line) < 160 for line in steps)


def _install_line(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("would run") and " -e " in line)


def test_the_lock_constrains_the_install_unless_it_is_emptied(tmp_path, reachable_index):
    output = _dry_run(tmp_path, reachable_index, gpu=False)
    install = _install_line(output)
    assert install.split("--constraint ")[1].split()[0].endswith("requirements/dev.lock")
    assert "(the tested set)" in output
    unlocked = _dry_run(tmp_path, reachable_index, gpu=False, DECODEKIT_LOCK="")
    assert "--constraint" not in _install_line(unlocked) and "(DECODEKIT_LOCK is empty)" in unlocked


def test_the_lock_pins_every_requirement_but_torch():
    import re

    import tomllib

    root = SETUP.parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    names = {re.split(r"[<>=!;\[ ]", requirement)[0].lower().replace("_", "-") for requirement in wanted}
    lock = (root / "requirements" / "dev.lock").read_text()
    pinned = {line.split("==")[0].lower() for line in lock.splitlines() if "==" in line and not line.startswith("#")}
    assert names - {"torch"} <= pinned, sorted(names - {"torch"} - pinned)
    assert "torch" not in pinned and (root / "requirements" / "torch.txt").read_text().count("torch==") == 1
