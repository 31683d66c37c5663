"""The quality protocol of the KV-cache benchmark, fixed before any tuning.

Four texts of different kinds that ship with Python or with Debian, each scored as the perplexity
of a continuation after a compressed context, and a query-agnostic retrieval task: a pass key
hidden at a random depth in about 2k tokens of filler, the context compressed before the
question is seen, the answer decoded greedily and judged by exact match.

Tuning (choosing defaults) uses TUNING_TEXTS and SECOND_TUNING_TEXTS only, which share no text with
PROTOCOL_TEXTS: the figures the benchmark reports are never the ones the defaults were chosen on.
"""

from __future__ import annotations

import argparse
import random
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _topics(*names: str) -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in names)


def _file(path: Path) -> str:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the benchmark's texts ship with Python and Debian's base-files")
    return path.read_text(encoding="utf-8", errors="replace")


# name -> (kind, loader). Reported figures come from these four.
PROTOCOL_TEXTS: dict[str, tuple[str, Callable[[], str]]] = {
    "gpl3": ("legal prose", lambda: _file(Path("/usr/share/common-licenses/GPL-3"))),
    "argparse.py": ("code", lambda: _file(STDLIB / "argparse.py")),
    "pydoc types": (
        "technical reference",
        lambda: _topics("typesseq", "typesmapping", "typesmethods", "typesmodules", "typesfunctions"),
    ),
    "idle NEWS": ("lists", lambda: _file(STDLIB / "idlelib" / "NEWS.txt")),
}
# Texts to tune on; never reported as the benchmark's figures.
TUNING_TEXTS: dict[str, tuple[str, Callable[[], str]]] = {
    "pydoc data model": ("technical reference", lambda: _topics("specialnames", "compound")),
    "inspect.py": ("code", lambda: _file(STDLIB / "inspect.py")),
    "idle NEWS2x": ("lists", lambda: _file(STDLIB / "idlelib" / "NEWS2x.txt")),
    "gfdl-1.3": ("legal prose", lambda: _file(Path("/usr/share/common-licenses/GFDL-1.3"))),
}
# Four more texts to tune on, of the same kinds, added where the first four hid a loss: 4-bit keys cost them
# +0.01% in mean perplexity and these +0.78% (``benchmarks/results/kv_key_bits_cpu.txt``).
SECOND_TUNING_TEXTS: dict[str, tuple[str, Callable[[], str]]] = {
    "pydoc strings": ("technical reference", lambda: _topics("formatstrings", "string-methods", "execmodel")),
    "typing.py": ("code", lambda: _file(STDLIB / "typing.py")),
    "idle ChangeLog": ("lists", lambda: _file(STDLIB / "idlelib" / "ChangeLog")),
    "gpl2": ("legal prose", lambda: _file(Path("/usr/share/common-licenses/GPL-2"))),
}
# The sets a benchmark's ``--texts`` names.
TEXT_SETS = {"tuning": TUNING_TEXTS, "tuning2": SECOND_TUNING_TEXTS, "protocol": PROTOCOL_TEXTS}


def texts_named(names: str, texts: dict) -> dict:
    """The texts of ``texts`` named in ``names`` (comma-separated), in their set's order; an argparse type's
    error names the unknown ones and what may be named.

    Example:
        >>> list(texts_named("inspect.py", TUNING_TEXTS))
        ['inspect.py']
    """
    chosen = {name.strip() for name in names.split(",") if name.strip()}
    unknown = chosen - set(texts)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {sorted(unknown)}; name one or more of {', '.join(texts)}")
    if not chosen:
        raise argparse.ArgumentTypeError(f"no text named; name one or more of {', '.join(texts)}")
    return {name: text for name, text in texts.items() if name in chosen}


def add_tuning_texts_argument(parser: argparse.ArgumentParser) -> None:
    """``--texts``: the tuning texts to measure, by name (all of them by default); ``args.texts`` is their dict."""
    parser.add_argument(
        "--texts", type=lambda names: texts_named(names, TUNING_TEXTS), default=TUNING_TEXTS,
        help=f"the tuning texts to measure, comma-separated (default: all of {', '.join(TUNING_TEXTS)})",
    )  # fmt: skip


def add_text_arguments(parser: argparse.ArgumentParser) -> None:
    """``--texts``, a set of texts (the tuning texts by default), and ``--only``, some texts of it by name."""
    parser.add_argument("--texts", choices=sorted(TEXT_SETS), default="tuning")
    parser.add_argument("--only", help="of the set, the texts to measure, comma-separated (default: all)")


def chosen_texts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The texts that ``add_text_arguments``' options chose; a name not in the set ends the script by argparse."""
    texts = TEXT_SETS[args.texts]
    if args.only is None:
        return texts
    try:
        return texts_named(args.only, texts)
    except argparse.ArgumentTypeError as error:
        parser.error(f"--only: {error}")


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class PassKeyTask:
    context: str
    question: str
    answer: str


def pass_key_tasks(count: int, *, filler_repeats: int = 80, seed: int = 0) -> list[PassKeyTask]:
    """``count`` pass-key tasks (about 2k tokens each), the key at a random depth, reproducible from ``seed``."""
    rng = random.Random(seed)
    tasks = []
    for _ in range(count):
        key = str(rng.randint(10_000, 99_999))
        before = int(filler_repeats * rng.random())
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        context = INTRO + FILLER * before + needle + FILLER * (filler_repeats - before)
        tasks.append(PassKeyTask(context, QUESTION, key))
    return tasks


def text_tasks(tokenizer, texts: dict, context_tokens: int, continuation_tokens: int) -> dict[str, dict]:
    """Per text: its kind and the token ids of the context and of the continuation that follows it."""
    tasks = {}
    for name, (kind, load) in texts.items():
        ids = tokenizer(load(), add_special_tokens=False)["input_ids"]
        needed = context_tokens + continuation_tokens
        if len(ids) < needed:
            raise ValueError(f"text {name!r} has {len(ids)} tokens; the protocol needs {needed}")
        tasks[name] = {
            "kind": kind,
            "context": ids[:context_tokens],
            "continuation": ids[context_tokens:needed],
        }
    return tasks


def encoded_pass_keys(tokenizer, count: int, seed: int, filler_repeats: int = 80) -> list[dict]:
    """Pass-key tasks as token ids, the form both virtualenvs read."""
    return [
        {
            "context": tokenizer(task.context)["input_ids"],
            "question": tokenizer(task.question, add_special_tokens=False)["input_ids"],
            "answer": task.answer,
        }
        for task in pass_key_tasks(count, seed=seed, filler_repeats=filler_repeats)
    ]


def run_tasks(model, tokenizer, tasks: dict, make_cache: Callable[[float], object], method: str) -> list[dict]:
    """The protocol for one of our caches: rows like the kvpress runner's, one per (ratio, task)."""
    import time

    import torch

    from decodekit.cache import CompressedCache
    from decodekit.eval.perplexity import continuation_perplexity

    device = model.device
    rows = []
    for ratio in tasks["ratios"]:
        for name, task in tasks["texts"].items():
            context = torch.tensor([task["context"]], device=device)
            continuation = torch.tensor([task["continuation"]], device=device)
            started = time.perf_counter()
            value = continuation_perplexity(model, make_cache(ratio), context, continuation)
            rows.append({"method": method, "ratio": ratio, "task": name, "perplexity": value,
                         "seconds": time.perf_counter() - started})  # fmt: skip
        hits = 0
        for task in tasks["pass_keys"]:
            context = torch.tensor([task["context"]], device=device)
            ids = torch.cat([context, torch.tensor([task["question"]], device=device)], dim=1)
            cache = make_cache(ratio)
            with torch.no_grad():
                model(context, past_key_values=cache)
                if isinstance(cache, CompressedCache):
                    cache.end_context()  # (the question is not part of the context)
                output = model.generate(
                    ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=7,
                    do_sample=False, pad_token_id=tokenizer.eos_token_id,
                )  # fmt: skip
            hits += task["answer"] in tokenizer.decode(output[0, ids.shape[1] :])
        rows.append({"method": method, "ratio": ratio, "task": "pass key", "accuracy": hits / len(tasks["pass_keys"])})
    return rows
