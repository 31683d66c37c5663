"""``decodekit compress`` and ``decodekit generate --context``: the library's numbers and answers, one-line errors."""

from __future__ import annotations

import io
import re
from pydoc_data.topics import topics

import pytest

from decodekit import Strategy
from decodekit import models as models_module
from decodekit.cache import CompressedCache
from decodekit.cache.persist import read_header
from decodekit.cli import main
from decodekit.context import Context

DOCUMENT = topics["assert"] + topics["pass"]


@pytest.fixture
def document(tmp_path):
    path = tmp_path / "report.txt"
    path.write_text(DOCUMENT, encoding="utf-8")
    return path


def _run(capsys, *argv):
    try:
        code = main([str(arg) for arg in argv])
    except SystemExit as exit_:  # argparse refuses bad flag values itself
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _numbers(line: str) -> dict[str, int]:
    match = re.search(
        r"(\d+) tokens seen, (\d+) kept per layer and KV head; ([\d,]+) bytes in memory \(.*?([\d,]+)\), "
        r"([\d,]+) bytes on disk",
        line,
    )
    assert match, line
    seen, kept, held, full, disk = (int(group.replace(",", "")) for group in match.groups())
    return {"seen": seen, "kept": kept, "held": held, "full": full, "disk": disk}


@pytest.mark.parametrize(
    ("flags", "cache"),
    [
        ((), {"memory_fraction": 0.1, "scoring": "reconstruction"}),  # the default: a tenth of the bytes
        (("--memory-fraction", "0.2"), {"memory_fraction": 0.2, "scoring": "reconstruction"}),
        (("--kv-budget", "48"), {"budget": 48, "scoring": "reconstruction"}),
        (("--kv-ratio", "0.8", "--kv-scoring", "attention"), {"compression_ratio": 0.8}),
    ],
)
def test_compress_then_ask_prints_the_librarys_numbers_and_answers(tiny, tiny_model_dir, document, capsys, flags,
                                                                   cache):  # fmt: skip
    model, tokenizer = tiny
    output = document.with_suffix(".kv")
    code, out, err = _run(capsys, "compress", document, "--model", tiny_model_dir, *flags, "-o", output)
    assert code == 0, err
    expected = Context.compress(model, tokenizer, DOCUMENT, CompressedCache(model, **cache))
    numbers = _numbers(out)
    assert numbers["seen"] == expected.seen and numbers["kept"] == expected.kept
    assert numbers["held"] == expected.memory_bytes() and numbers["disk"] == output.stat().st_size
    assert numbers["full"] == expected.summary(model)["full_16bit_bytes"]
    chunks = re.findall(r"(\d+)/(\d+) \[", err)  # the progress bar over the chunks
    assert chunks and chunks[-1][0] == chunks[-1][1]
    assert read_header(output)["token_ids"] == expected.token_ids
    for question in ("What does assert do?", "When is pass useful?"):
        code, out, err = _run(capsys, "generate", "--context", output, question, "--model", tiny_model_dir,
                              "--max-new-tokens", "12")  # fmt: skip
        assert code == 0, err
        assert out.rstrip("\n") == expected.ask(model, tokenizer, question, max_new_tokens=12).rstrip("\n")
        assert f"(a fork of {output})" in err and "KV cache:" in err


def test_a_context_answers_with_beam_search_and_sampling_flags(tiny, tiny_model_dir, document, capsys):
    model, tokenizer = tiny
    output = document.with_suffix(".kv")
    assert _run(capsys, "compress", document, "--model", tiny_model_dir, "--kv-budget", "48")[0] == 0  # default -o
    context = Context.load(output, model)
    code, out, _ = _run(capsys, "generate", "--context", output, "Hi", "--model", tiny_model_dir, "--num-beams", "3",
                        "--max-new-tokens", "8", "--no-stream")  # fmt: skip
    assert code == 0 and out == context.ask(model, tokenizer, "Hi", Strategy(num_beams=3), max_new_tokens=8) + "\n"
    argv = ["generate", "--context", output, "Hi", "--model", tiny_model_dir, "--temperature", "1.2", "--seed", "3",
            "--max-new-tokens", "8", "--no-stream"]  # fmt: skip
    assert _run(capsys, *argv) == _run(capsys, *argv)


def test_a_document_from_standard_input_and_raw_framing(tiny, tiny_model_dir, tmp_path, capsys, monkeypatch):
    model, tokenizer = tiny
    monkeypatch.setattr("sys.stdin", io.StringIO(DOCUMENT))
    output = tmp_path / "stdin.kv"
    code, _, err = _run(capsys, "compress", "-", "--raw", "-o", output, "--model", tiny_model_dir)
    assert code == 0, err
    context = Context.load(output, model)
    assert not context.chat and context.token_ids == tokenizer(DOCUMENT)["input_ids"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compress", "{tmp}/missing.txt"], "missing.txt: no such file"),
        (["compress", "{tmp}"], "is a folder: give a text file"),
        (["compress", "{tmp}/empty.txt"], "empty.txt is empty: the document needs some text"),
        (["compress", "{tmp}/latin1.txt"], "latin1.txt is not UTF-8 text"),
        (["compress", "{tmp}/report.txt", "-o", "{tmp}/no/such/out.kv"], "--output: cannot write"),
        (["compress", "{tmp}/report.txt", "-o", "{tmp}/report.txt"], "is the document itself"),
        (["compress", "-"], "name the file to write with -o"),
        (["compress", "{tmp}/report.txt", "--kv-budget", "8"], "--kv-budget: must be >= 36"),
        (["compress", "{tmp}/report.txt", "--memory-fraction", "0"],
         "--kv-memory/--memory-fraction: must be in (0, 1]"),
        (["compress", "{tmp}/report.txt", "--kv-ratio", "0.5", "--kv-budget", "64"], "not allowed with argument"),
        (["compress", "{tmp}/report.txt", "--kv-budget", "64", "--kv-bits", "16", "--kv-residual-length", "4"],
         "--kv-residual-length applies to keys and values stored in 8, 5, 4, 3 or 2 bits"),
        (["generate", "Q?", "--context", "{tmp}/missing.kv"], "missing.kv: no such file"),
        (["generate", "Q?", "--context", "{tmp}/report.txt"], "report.txt is not a readable decodekit cache file"),
        (["generate", "Q?", "--context", "{tmp}/x.kv", "--kv-budget", "64"],
         "--kv-budget applies when compressing (decodekit compress)"),
        (["generate", "Q?", "--context", "{tmp}/x.kv", "--raw"], "--raw does not apply with --context"),
        (["generate", "Q?", "--context", "{tmp}/x.kv", "--system", "Be brief."], "--system does not apply"),
        (["generate", "Q?", "--context", "{tmp}/x.kv", "--trace", "3"], "--trace does not apply with --context"),
        (["generate", "", "--context", "{tmp}/x.kv"], "prompts[0] is empty"),
    ],
)  # fmt: skip
def test_bad_input_gets_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, argv, message):
    (tmp_path / "report.txt").write_text(DOCUMENT, encoding="utf-8")
    (tmp_path / "empty.txt").write_text(" \n", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(models_module, "load_model", no_model)
    code, _, err = _run(capsys, *[arg.format(tmp=tmp_path) for arg in argv])
    assert code == 2 and message in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1


def test_a_context_for_another_model_or_dtype_is_refused_in_one_line(tiny_model_dir, document, capsys, tmp_path):
    from tests.families import build_family_model

    output = document.with_suffix(".kv")
    assert _run(capsys, "compress", document, "--model", tiny_model_dir, "--kv-budget", "48")[0] == 0
    code, _, err = _run(capsys, "generate", "--context", output, "Q?", "--model", tiny_model_dir, "--dtype",
                        "bfloat16")  # fmt: skip
    assert code == 2 and "was saved from a float32 model; this one is bfloat16" in err and "Traceback" not in err
    other = tmp_path / "other-model"
    build_family_model("qwen2").save_pretrained(other)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / name).write_bytes((tiny_model_dir / name).read_bytes())
    code, _, err = _run(capsys, "generate", "--context", output, "Q?", "--model", other)
    assert code == 2 and "was saved for another model: config model_type is 'llama' there" in err
    data = bytearray(output.read_bytes())
    data[-20] ^= 0xFF
    output.write_bytes(bytes(data))
    code, _, err = _run(capsys, "generate", "--context", output, "Q?", "--model", tiny_model_dir)
    assert code == 2 and "is corrupted" in err and "Traceback" not in err
