"""The README's Python blocks run when pasted in order into one session, and its lists stay complete."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

import decodekit

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _run_blocks(monkeypatch, model_and_tokenizer) -> list[str]:
    """Run every block in one namespace, as if pasted in order; return what each printed."""
    monkeypatch.setattr(decodekit, "load_model", lambda *args, **kwargs: model_and_tokenizer)
    namespace: dict = {"__name__": "__readme__"}
    printed = []
    for number, block in enumerate(python_blocks()):
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            try:
                exec(compile(block, f"README block {number}", "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"README block {number} failed: {type(error).__name__}: {error}") from error
        printed.append(output.getvalue())
    return printed


def _check(printed: list[str]) -> None:
    assert len(printed) >= 6
    for number, text in enumerate(printed):
        assert text.strip(), f"README block {number} prints nothing"
    cache_line = next(text for text in printed if text.startswith("seen "))
    seen, kept = map(int, re.match(r"seen (\d+) tokens, kept (\d+)", cache_line).groups())
    assert kept < seen  # the cache example shows an eviction


def test_the_readme_blocks_run_in_order_on_the_tiny_model(monkeypatch, fresh_tiny):
    _check(_run_blocks(monkeypatch, fresh_tiny))


@pytest.mark.slow
def test_the_readme_blocks_run_in_order_on_the_default_model(monkeypatch, real):
    _check(_run_blocks(monkeypatch, real))


def test_the_readme_documents_every_command_line_flag():
    from decodekit.cli import _build_parser

    text = README.read_text()
    parser = _build_parser()
    commands = next(action for action in parser._actions if action.dest == "command").choices
    missing = [
        f"{name} {flag}"
        for name, command in commands.items()
        for action in command._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help" and f"`{flag}" not in text
    ]
    assert not missing, f"flags missing from README.md: {', '.join(missing)}"


def test_the_readme_lists_every_decoding_field_with_its_flag():
    from decodekit.fields import FIELDS

    text = README.read_text()
    missing = [field.name for field in FIELDS if f"`{field.name}` (`{field.cli_flag}`)" not in text]
    assert not missing, f"decoding fields missing from README.md's table: {missing}"
