"""Compress once, ask many times: questions answered from a saved compressed context against the document re-read.

    python benchmarks/kv_reuse.py [--document-tokens 4096] [--questions 10] [--memory-fraction 0.1] [--rounds 3]
    python benchmarks/kv_reuse.py --model DIR --document-tokens 400 --questions 3 --rounds 1 --retrieval-count 1

Prints, measured side by side in one run on the default model (SmolLM2-135M-Instruct) on --threads threads (1):

  1. time: --questions questions about a --document-tokens document of natural prose (Python's IDLE help, with one
     keyed number per question at evenly spread depths), each answered greedily (--new-tokens tokens):
       saved context: the file loaded (its checks, the weights' fingerprint included, as in a fresh process),
                      then a fork of it per question (the question's pass and its answer)
       full cache:    the document and the question read with the full cache, one prefill per question
     in --rounds interleaved rounds, medians; the ratio full / saved           (target: >= 5x end to end)
     and, once per round, what the context cost to make (compress and save), and that cost with the answers
     against the full cache's answers (the break-even).
  2. bytes on disk: the context's file against the full cache saved the same way (a CompressedCache that keeps
     every token in 16 bits, written by the same save) and against a full 16-bit cache's bytes
                                                                                (target: <= 0.11x)
  3. answers: each question's answer from the loaded context (the first round's) against the context compressed
     in this process                                                            (target: identical, token by token)
     and the numbers each retrieves, beside the full cache's.
  4. retrieval (kv_retrieval.py's natural-prose tasks, --retrieval-count per kind, --retrieval-tokens tokens,
     raw, exact match): hits with the context compressed in the process against the same context saved and
     loaded from disk (target: the same answers); with --retrieval-full, beside the full cache's (one more
     prefill per task).

Every context is ``scoring="reconstruction"`` (query-agnostic) at ``memory_fraction`` of a full 16-bit cache's
bytes. The output starts with the command and its conditions.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _timing import verdict  # benchmarks/ is on sys.path when a script in it runs
from kv_retrieval import INTRO, KINDS, _insert, _prose, retrieval_tasks

from decodekit import load_model
from decodekit.cache import CompressedCache, full_cache_bytes, persist
from decodekit.context import Context

KEYS = ("amber", "falcon", "harbor", "violet", "cedar", "meteor", "lantern", "glacier", "orchid", "summit",
        "pebble", "canyon", "willow", "comet", "tundra", "saffron")  # fmt: skip
HAYSTACK = "idle help"  # about 8.5k tokens of prose in SmolLM2's tokenizer


def keyed_document(tokenizer, tokens: int, questions: int, seed: int = 0) -> tuple[list[int], list[dict]]:
    """About ``tokens`` token ids of prose with ``questions`` keyed numbers at evenly spread depths (raw: the
    tokenizer's own special tokens), and per key ``{"question": ids, "answer": digits, "key", "depth"}``."""
    if questions > len(KEYS):
        raise ValueError(f"--questions must be at most {len(KEYS)}")
    rng = random.Random(f"kv-reuse/{seed}")
    keys = list(KEYS[:questions])
    values = [str(rng.randint(10_000, 99_999)) for _ in keys]
    depths = [(index + 0.5) / questions for index in range(questions)]
    rng.shuffle(depths)
    needles = [f"The special magic number for {key} is {value}." for key, value in zip(keys, values, strict=True)]
    reserved = len(tokenizer(INTRO + " ".join(needles))["input_ids"])
    prose = _prose(tokenizer, HAYSTACK, max(tokens - reserved, 16))
    ids = tokenizer(INTRO + _insert(prose, needles, depths))["input_ids"]
    asked = [
        {"key": key, "answer": value, "depth": round(depth, 3), "question": tokenizer(
            f"\nWhat is the special magic number for {key}? The special magic number for {key} is",
            add_special_tokens=False)["input_ids"]}
        for key, value, depth in zip(keys, values, depths, strict=True)
    ]  # fmt: skip
    return ids, asked


def compressed(model, ids: list[int], fraction: float) -> Context:
    return Context.from_ids(model, ids, CompressedCache(model, memory_fraction=fraction, scoring="reconstruction"))


def _answers(context: Context, model, tokenizer, asked: list[dict], new_tokens: int, full: bool = False):
    return [context.answer(model, tokenizer, item["question"], max_new_tokens=new_tokens, full=full) for item in asked]


def _conditions(model, args) -> str:
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    name = args.model or "SmolLM2-135M-Instruct (the default model)"
    return (f"# {name} in {dtype}, {torch.get_num_threads()} thread(s) of a {os.cpu_count()}-core "
            f"{platform.machine()} CPU, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory or id (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--document-tokens", type=int, default=4096)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens each answer generates")
    parser.add_argument("--memory-fraction", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--retrieval-count", type=int, default=20, help="retrieval tasks per kind (0: none)")
    parser.add_argument("--retrieval-tokens", type=int, default=2000)
    parser.add_argument("--retrieval-full", action="store_true", help="also the full cache's retrieval hits")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    for name in ("document_tokens", "questions", "new_tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.memory_fraction <= 1:
        parser.error("--memory-fraction must be in (0, 1]")
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(args.model)
    print("# python benchmarks/kv_reuse.py " + " ".join(sys.argv[1:]))
    print(_conditions(model, args), flush=True)
    folder = Path(tempfile.mkdtemp(prefix="kv-reuse-"))
    path = folder / "document.kv"
    ids, asked = keyed_document(tokenizer, args.document_tokens, args.questions)
    print(f"document: {len(ids)} tokens ({HAYSTACK} prose, {args.questions} keyed numbers), {args.questions} "
          f"questions, {args.new_tokens} new tokens each, memory_fraction={args.memory_fraction} with "
          "reconstruction scores", flush=True)  # fmt: skip

    # 1. time, side by side
    samples = {"saved": [], "full": [], "make": []}
    answers = {}  # the first round's answers, from the file and from the full cache
    in_place = None
    for round_index in range(args.rounds):
        started = time.perf_counter()
        in_place = compressed(model, ids, args.memory_fraction)
        in_place.save(path)
        samples["make"].append(time.perf_counter() - started)

        def saved_context() -> None:
            persist._FINGERPRINTS.clear()  # (a fresh process hashes the weights: count it)
            started = time.perf_counter()
            context = Context.load(path, model)
            given = _answers(context, model, tokenizer, asked, args.new_tokens)
            samples["saved"].append(time.perf_counter() - started)
            answers.setdefault("file", given)

        def full_cache(context: Context = in_place) -> None:
            started = time.perf_counter()
            given = _answers(context, model, tokenizer, asked, args.new_tokens, full=True)
            samples["full"].append(time.perf_counter() - started)
            answers.setdefault("full", given)

        for run in (saved_context, full_cache) if round_index % 2 == 0 else (full_cache, saved_context):
            run()
        print(f"  round {round_index + 1}: saved context {samples['saved'][-1]:.2f} s, full cache "
              f"{samples['full'][-1]:.2f} s, compress and save {samples['make'][-1]:.2f} s", flush=True)  # fmt: skip
    saved, full, make = (statistics.median(samples[name]) for name in ("saved", "full", "make"))
    speedup = full / saved
    print(f"1. {args.questions} questions, medians of {args.rounds} interleaved rounds:")
    print(f"   full cache / saved context time: {speedup:.2f}x   ({verdict(speedup >= 5)}: >= 5x)")
    per_answer = full / args.questions
    print(f"   with the one-time compress and save: full / (compress, save and answers) = "
          f"{full / (make + saved):.2f}x; compressing costs {make / per_answer:.2f} full answers")  # fmt: skip

    # 2. bytes on disk
    context_bytes = path.stat().st_size
    every_token = Context.from_ids(model, ids, CompressedCache(model, kv_bits=16))
    full_path = every_token.save(folder / "full.kv")
    full_file, full_16 = full_path.stat().st_size, full_cache_bytes(model, len(ids), element_size=2)
    print("2. bytes on disk:")
    print(f"   the context's file {context_bytes:,} against the full cache saved the same way {full_file:,}: "
          f"{context_bytes / full_file:.3f}x")  # fmt: skip
    ratio = context_bytes / full_16
    print(f"   against a full 16-bit cache's {full_16:,} bytes: {ratio:.3f}x   ({verdict(ratio <= 0.11)}: <= 0.11x); "
          f"held in memory {in_place.memory_bytes():,} ({in_place.memory_bytes() / full_16:.3f}x)")  # fmt: skip
    full_path.unlink()
    del every_token

    # 3. answers
    from_file, from_full = answers["file"], answers["full"]
    from_place = _answers(in_place, model, tokenizer, asked, args.new_tokens)
    same = sum(a.token_ids == b.token_ids for a, b in zip(from_file, from_place, strict=True))
    print(f"3. answers from the loaded context identical to the context compressed in this process: {same} of "
          f"{len(asked)}   ({verdict(same == len(asked))}: all)")  # fmt: skip
    hits = [sum(item["answer"] in answer.text for item, answer in zip(asked, answers, strict=True))
            for answers in (from_file, from_full)]  # fmt: skip
    print(f"   numbers retrieved: {hits[0]} of {len(asked)} from the context, {hits[1]} with the full cache")

    # 4. retrieval
    if args.retrieval_count:
        print(f"4. retrieval, {args.retrieval_count} tasks per kind, {args.retrieval_tokens}-token contexts "
              "(kv_retrieval.py), exact match:")  # fmt: skip
        total_same = total = 0
        for kind in KINDS:
            tasks = retrieval_tasks(tokenizer, kind, args.retrieval_count, context_tokens=args.retrieval_tokens)
            counts = {"in process": 0, "from disk": 0, "full cache": 0}
            same = 0
            for task in tasks:
                context = compressed(model, task["context"], args.memory_fraction)
                here = context.answer(model, tokenizer, task["question"], max_new_tokens=8)
                context.save(path)
                there = Context.load(path, model).answer(model, tokenizer, task["question"], max_new_tokens=8)
                given = [("in process", here), ("from disk", there)]
                if args.retrieval_full:
                    given.append(("full cache", context.answer(model, tokenizer, task["question"], max_new_tokens=8,
                                                               full=True)))  # fmt: skip
                for name, answer in given:
                    counts[name] += task["answer"] in answer.text
                same += here.token_ids == there.token_ids
            total_same, total = total_same + same, total + len(tasks)
            full = f"   full cache {counts['full cache']:3d}" if args.retrieval_full else ""
            print(f"   {kind:10s} in process {counts['in process']:3d}   from disk {counts['from disk']:3d}{full}   "
                  f"(of {len(tasks)}; identical answers {same})", flush=True)  # fmt: skip
        print(f"   answers from disk identical to in process: {total_same} of {total}   "
              f"({verdict(total_same == total)}: all)")  # fmt: skip
    path.unlink(missing_ok=True)
    folder.rmdir()


if __name__ == "__main__":
    main()
