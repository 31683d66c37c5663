"""decodekit's CompressedCache against the full cache and NVIDIA's kvpress presses.

    python benchmarks/kv_cache.py [--device cpu|cuda] [--skip-kvpress | --presses-from FILE]
    python benchmarks/kv_cache.py --presses-from benchmarks/results/kv_protocol_cpu.jsonl   # a recorded press run
    python benchmarks/kv_cache.py --shape llama-1b --lengths 8192,32768 --device cuda   # GPU mode

Prints, measured side by side in one run on the default model (SmolLM2-135M-Instruct):
  1. quality (the protocol of kv_protocol.py, fixed before tuning): perplexity of a 512-token
     continuation after a 3072-token compressed context, for four texts of different kinds (mean and
     worst increase over the full cache), and a query-agnostic pass-key task (about 2k tokens, the
     context compressed before the question; exact match), at 50%, 75% and 90% evicted; ours
     (the default, and scoring="reconstruction") against every kvpress 0.5.5 press that runs
     offline                       (target: our default better than every press on both, each ratio)
  1b. quality per byte (benchmarks/_kv_per_byte.py): our byte-sized options at 50 / 75 / 87.5 / 90 / 95% of
     a full 16-bit cache's bytes removed, beside kvpress presses at the same share of tokens (their bytes
     counted as if freed), with natural-prose retrieval and the bytes held
                     (targets: mean <= +0.25% / +2% / +5% at 75 / 90 / 95% removed, worst below KVzip's,
                      retrieval >= 90% of the full cache's)
  2. prefill cost: time (and peak memory on CUDA) of the compressed prefill / DynamicCache's
                                                                          (target: <= 1.3x, <= 1.0x)
     and of the cache with the best quality per byte (a quarter of the bytes, reconstruction scoring)
                                                                          (target: <= 2.5x)
  3. decoding: tokens/s after a 4096-token prompt, 25% budget / DynamicCache   (target: >= 1.1x)
     and at a quarter of the bytes with reconstruction scoring               (target: >= 1.54x)
  4. long generation: 2048 new tokens under a 256-token budget: the most tokens held at any step,
     and tokens/s against the full cache                                  (target: >= 1.0x)
  5. peak (benchmarks/_kv_peak.py): the most bytes a cache held at any moment through a whole generate
     (--prefill-tokens prompt, --peak-new-tokens new tokens), memory_fraction=0.25 scored by attention and by
     reconstruction, read in one pass and in
     chunks of --peak-chunks tokens, against a full 16-bit cache   (target: chunked <= the fraction + one chunk)

Host-bound mode (--host-bound): a random Llama of 16 layers, hidden size 64, 8 query and 4 KV heads, on
the CPU; a 512-token prompt, then greedy steps, tokens/s as the median of interleaved rounds, each cache
against DynamicCache (target for the default CompressedCache: >= 0.95x), with rows for 8 and 4 bits and
for the byte-sized reconstruction cache (memory_fraction=0.25). Then (unless --no-host-compile)
the same decoding by hand, eager and through torch.compile(model.forward, fullgraph=True) with inductor,
for DynamicCache, StaticCache, CompressedCache(eviction_interval=1), the setting that compiles to one
graph, the default interval, which compiles to four graphs, and eviction_interval=1 with keys and values
in 4 bits (target: ours compiled >= StaticCache compiled).

GPU mode (--shape llama-1b): a random-weight model of Llama-3.2-1B's shape in bf16 (speed and memory
do not depend on the weights), batch 1, 25% budget, at each of --lengths: prefill time, peak memory
above the weights, decode tokens/s and cache bytes, for DynamicCache, the default CompressedCache (its
eviction interval a 32nd of the budget), eviction_interval=8, scoring_backend='torch' (up to 8k tokens) and
observation_window=64, with the most a step bound by the bytes it reads (weights and cache, at one rate) could
gain over DynamicCache; then compiled decoding (--gpu-compile-modes, on CUDA by default): StaticCache and
CompressedCache with eviction_interval=1 (whose steps CUDA graphs capture, mode="reduce-overhead"; also with
kv_bits=4) and at its default interval through torch.compile(model.forward), beside eager (the default
interval without CUDA graphs, which would record anew at every step). --shape tiny runs the same code on CPU
in seconds (the benchmark's own test).

kvpress 0.5.5 pins transformers < 5.3, so it runs in its own virtualenv: --kvpress-python, else
$KVPRESS_PYTHON, else .venv-kvpress/ (created with torch==2.13.0 and kvpress==0.5.5 if missing).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import _kv_peak as peak_bytes
import _kv_per_byte as per_byte
import torch
from _timing import verdict  # benchmarks/ is on sys.path when a script in it runs
from kv_protocol import PROTOCOL_TEXTS, encoded_pass_keys, run_tasks, text_tasks, texts_named
from torch._dynamo.utils import counters
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
)

from decodekit import encode_prompts, load_model
from decodekit.cache import CompressedCache

ROOT = Path(__file__).resolve().parent.parent
RATIOS = (0.5, 0.75, 0.9)
KVPRESS_VENV = ROOT / ".venv-kvpress"
SHAPES = {
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256},
    # Small enough that a decoding step on a CPU is bound by the host (Python, operator dispatch), as a
    # 1B model's step is on a GPU at batch 1.
    "host-bound": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 16, "num_attention_heads": 8,
                   "num_key_value_heads": 4, "head_dim": 8, "vocab_size": 256},
}  # fmt: skip


def weight_bytes_read(model) -> int:
    """Bytes of weights a decoding step reads at the least: every parameter once (a tied embedding once, as the output
    projection reads it whole), an untied input embedding not at all (a step reads one row of it)."""
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    skip = None if output is not None and output.weight is embedding else id(embedding)
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) != skip)


def memory_bound_ceiling(weights: float, full_cache: float, kept_cache: float) -> float:
    """The most a cache holding ``kept_cache`` bytes can speed up a decoding step over one holding ``full_cache``,
    where a step is bound by the bytes it reads (``weights`` plus the cache), as at batch 1 on a GPU once the host
    keeps up: ``(weights + full_cache) / (weights + kept_cache)``.

    Example:
        >>> round(memory_bound_ceiling(2.0, 1.0, 0.25), 3)
        1.333
    """
    return (weights + full_cache) / (weights + kept_cache)


def cache_bytes(cache) -> int:
    if isinstance(cache, CompressedCache):
        return cache.memory_bytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def kvpress_python(args) -> Path | None:
    """The python of a virtualenv with kvpress, created if needed; None when skipped."""
    if args.skip_kvpress:
        return None
    chosen = args.kvpress_python or os.environ.get("KVPRESS_PYTHON")
    if chosen:
        return Path(chosen)
    python = KVPRESS_VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {KVPRESS_VENV} with kvpress 0.5.5 (once)...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(KVPRESS_VENV)], check=True)
        torch_spec = os.environ.get("TORCH_SPEC", "torch==2.13.0")
        subprocess.run([str(python), "-m", "pip", "install", "-q", torch_spec, "kvpress==0.5.5"], check=True)
    return python


def protocol_texts(names: str) -> dict:
    """The protocol's texts named in ``names`` (comma-separated), in the protocol's order."""
    return texts_named(names, PROTOCOL_TEXTS)


def press_rows(args, model, tasks: dict) -> list[dict]:
    """The presses' rows: read from --presses-from, or measured now in kvpress's virtualenv."""
    if args.presses_from:  # only the presses' rows: ours are measured now
        return recorded_press_rows(args.presses_from, tasks["texts"])
    python = kvpress_python(args)
    return [] if python is None else run_presses(python, model, tasks)


def _read_rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def recorded_press_rows(path: str, texts) -> list[dict]:
    """The presses' rows of a recorded run, their perplexities only on ``texts`` (the texts measured now)."""
    rows = [row for row in _read_rows(path) if row["method"].startswith("kvpress")]
    return [row for row in rows if "perplexity" not in row or row["task"] in texts]


def run_presses(python: Path, model, tasks: dict, chosen: list[str] | None = None) -> list[dict]:
    """Measure kvpress presses (``chosen``, else all) on ``tasks`` in their own virtualenv."""
    with tempfile.TemporaryDirectory() as directory:
        tasks_path, out = Path(directory) / "tasks.json", Path(directory) / "presses.jsonl"
        tasks_path.write_text(json.dumps(tasks))
        runner = [str(python), str(Path(__file__).parent / "_kvpress_runner.py"), model.name_or_path]
        command = [*runner, str(tasks_path), str(out), *(chosen or [])]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode:
            raise RuntimeError(f"kvpress run failed:\n{result.stderr[-3000:]}")
        return _read_rows(str(out))


def byte_press_rows(args, model):
    """For the quality-per-byte section: a function of the tasks giving the presses' rows, read from
    --byte-presses-from or measured now (and kept in --save-byte-presses)."""

    def rows(tasks: dict) -> list[dict]:
        if args.byte_presses_from:
            return recorded_press_rows(args.byte_presses_from, tasks["texts"])
        python = kvpress_python(args)
        if python is None:
            return []
        measured = run_presses(python, model, tasks, args.byte_presses.split(","))
        if args.save_byte_presses:
            Path(args.save_byte_presses).write_text("".join(json.dumps(row) + "\n" for row in measured))
        return measured

    return rows


def summarize(rows: list[dict], full: dict[str, float]) -> dict[str, dict[float, dict]]:
    """Per method and ratio: mean and worst perplexity increase over the full cache, pass-key accuracy."""
    table: dict[str, dict[float, dict]] = {}
    for row in rows:
        cell = table.setdefault(row["method"], {}).setdefault(row["ratio"], {"increases": []})
        if "perplexity" in row:
            cell["increases"].append((row["perplexity"] / full[row["task"]] - 1, row["task"]))
        elif "accuracy" in row:
            cell["pass_key"] = row["accuracy"]
        else:
            cell["error"] = row.get("error", "?")
    for cells in table.values():
        for cell in cells.values():
            increases = [value for value, _ in cell["increases"]]
            if increases and len(increases) == len(full):
                cell["mean"] = statistics.fmean(increases)
                cell["worst"] = max(cell["increases"])
    return table


def quality(model, tokenizer, args) -> None:
    texts = text_tasks(tokenizer, args.texts, args.context_tokens, args.continuation_tokens)
    tasks = {
        "ratios": list(RATIOS),
        "texts": {name: {"context": t["context"], "continuation": t["continuation"]} for name, t in texts.items()},
        "pass_keys": encoded_pass_keys(tokenizer, args.pass_keys, seed=0, filler_repeats=args.pass_key_filler),
    }
    full_rows = run_tasks(model, tokenizer, {**tasks, "ratios": [0.0]}, lambda ratio: DynamicCache(), "full cache")
    full = {row["task"]: row["perplexity"] for row in full_rows if "perplexity" in row}
    full_key = next(row["accuracy"] for row in full_rows if row["task"] == "pass key")
    ours = {
        "decodekit default": lambda ratio: CompressedCache(model, compression_ratio=ratio),
        "decodekit reconstruction": lambda ratio: CompressedCache(
            model, compression_ratio=ratio, scoring="reconstruction"
        ),
        "decodekit attention+novelty": lambda ratio: CompressedCache(
            model, compression_ratio=ratio, scoring="attention+novelty"
        ),
    }
    rows = [row for name, make in ours.items() for row in run_tasks(model, tokenizer, tasks, make, name)]
    rows += press_rows(args, model, tasks)
    table = summarize(rows, full)
    kinds = ", ".join(f"{name} ({t['kind']})" for name, t in texts.items())
    print(
        f"1. quality: {args.context_tokens}-token contexts of {kinds}; {args.continuation_tokens}-token continuations"
    )
    print(f"   full cache: perplexities {', '.join(f'{k} {v:.3f}' for k, v in full.items())}; pass key {full_key:.0%}")
    header = "".join(f"{f'{r:.0%}: mean':>13s}{'worst':>9s}{'key':>6s}" for r in RATIOS)
    print(f"   {'method (perplexity increase; pass-key accuracy)':50s}{header}")
    for method, cells in table.items():
        line = ""
        for ratio in RATIOS:
            cell = cells.get(ratio, {})
            if "error" in cell:
                line += f"{'error':>28s}"
                continue
            mean, worst = cell.get("mean"), cell.get("worst")
            line += f"{mean:+13.2%}" if mean is not None else f"{'-':>13s}"
            line += f"{worst[0]:+9.2%}" if worst is not None else f"{'-':>9s}"
            line += f"{cell['pass_key']:6.0%}" if "pass_key" in cell else f"{'-':>6s}"
        print(f"   {method:50s}{line}")
    errors = {method: cells for method, cells in table.items() if any("error" in c for c in cells.values())}
    for method, cells in errors.items():
        print(f"   {method} did not run: {next(c['error'] for c in cells.values() if 'error' in c)}")
    presses = {m: c for m, c in table.items() if m.startswith("kvpress") and m not in errors}
    if presses:
        default = table["decodekit default"]
        for ratio in RATIOS:
            mine = default[ratio]
            beaten_ppl = [m for m, c in presses.items() if c[ratio].get("mean", 1e9) <= mine["mean"]]
            beaten_key = [m for m, c in presses.items() if c[ratio].get("pass_key", -1) > mine["pass_key"]]
            wins = not beaten_ppl and not beaten_key
            detail = f"at least as low a mean: {', '.join(beaten_ppl) or 'none'}; a better pass key: "
            print(f"   {ratio:.0%}: default better than every press: {wins} ({verdict(wins)}); {detail}"
                  f"{', '.join(beaten_key) or 'none'}")  # fmt: skip
    else:
        print("   kvpress skipped")


# The cache with the best quality per byte: a quarter of a full 16-bit cache's bytes, layers and KV heads sharing
# the budget, reconstruction scores (at this size estimated in the prompt's own pass: replay="auto"), 4-bit storage.
BYTE_SIZED = "CompressedCache memory_fraction=0.25, scoring=reconstruction"


def byte_sized_cache(model, **options) -> CompressedCache:
    return CompressedCache(model, memory_fraction=0.25, scoring="reconstruction", **options)


# The same, its reconstruction scores had from a replay pass over the prompt.
REPLAYED = f"{BYTE_SIZED}, replay=forward"


def prefill_cost(model, tokenizer, args) -> None:
    ids = tokenizer(PROTOCOL_TEXTS["gpl3"][1](), add_special_tokens=False)["input_ids"][: args.prefill_tokens]
    prompt = torch.tensor([ids], device=model.device)
    candidates = {
        "DynamicCache": DynamicCache,
        "CompressedCache": lambda: CompressedCache(model, compression_ratio=0.75),
        BYTE_SIZED: lambda: byte_sized_cache(model),
        REPLAYED: lambda: byte_sized_cache(model, replay="forward"),
    }
    seconds: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(args.prefill_rounds):
        for name, make in candidates.items():
            started = time.perf_counter()
            with torch.no_grad():
                model(prompt, past_key_values=make(), logits_to_keep=1)
            seconds[name].append(time.perf_counter() - started)
    full, ours, byte_sized, replayed = (statistics.median(values) for values in seconds.values())
    ratio = ours / full
    print(f"\n2. prefill of {len(ids)} tokens (75% evicted): CompressedCache {ours:.2f} s, DynamicCache {full:.2f} s"
          f" (median of {args.prefill_rounds})")  # fmt: skip
    print(f"   CompressedCache / DynamicCache prefill time: {ratio:.2f}x ({verdict(ratio <= 1.3)})")
    ratio = byte_sized / full
    print(f"   {BYTE_SIZED}: {byte_sized:.2f} s, {ratio:.2f}x DynamicCache ({verdict(ratio <= 2.5)})")
    print(f"   {REPLAYED}: {replayed:.2f} s, {replayed / full:.2f}x DynamicCache")


class _StepClock(LogitsProcessor):
    """Records when each step's scores arrive; with ``track_held``, also how many tokens the cache holds then (read
    at every step, so only where that count is reported: a timing run leaves it out of its steps)."""

    def __init__(self, cache=None, track_held: bool = False):
        self.cache, self.times, self.held = cache, [], []
        self.track_held = track_held and isinstance(cache, CompressedCache)

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        if self.track_held:
            self.held.append(max(layer.kept for layer in self.cache.layers))
        return scores

    def tokens_per_second(self) -> float:
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])


def decode(model, input_ids, cache, new_tokens: int, track_held: bool = False) -> _StepClock:
    clock = _StepClock(cache, track_held)
    model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        past_key_values=cache,
        max_new_tokens=new_tokens + 1,
        min_new_tokens=new_tokens + 1,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([clock]),
    )
    return clock


def speed(model, tokenizer, args) -> None:
    ids = tokenizer(PROTOCOL_TEXTS["argparse.py"][1](), add_special_tokens=False)["input_ids"][: args.speed_prompt]
    prompt = torch.tensor([ids], device=model.device)
    budget = args.speed_prompt // 4
    caches = {
        "DynamicCache": DynamicCache,
        "CompressedCache": lambda: CompressedCache(model, budget=budget),
        "CompressedCache kv_bits=8": lambda: CompressedCache(model, budget=budget, kv_bits=8),
        "CompressedCache kv_bits=4": lambda: CompressedCache(model, budget=budget, kv_bits=4),
        "CompressedCache scoring=reconstruction": lambda: CompressedCache(
            model, budget=budget, scoring="reconstruction"
        ),
        "CompressedCache scoring=reconstruction, layers": lambda: CompressedCache(
            model, budget=budget, scoring="reconstruction", allocation="layers"
        ),
        BYTE_SIZED: lambda: byte_sized_cache(model),
    }
    rates = {name: [] for name in caches}
    for _ in range(args.speed_rounds):  # interleaved, so that a slow spell of the machine hits every cache
        for name, make in caches.items():
            rates[name].append(decode(model, prompt, make(), args.speed_tokens).tokens_per_second())
    medians = {name: statistics.median(values) for name, values in rates.items()}
    full, ours = medians["DynamicCache"], medians["CompressedCache"]
    ratio = ours / full
    print(f"\n3. decoding {args.speed_tokens} tokens after a {args.speed_prompt}-token prompt, budget {budget} (25%)")
    print(f"   DynamicCache {full:.2f} tok/s, CompressedCache {ours:.2f} tok/s (median of {args.speed_rounds})")
    print(f"   CompressedCache / DynamicCache tokens/s: {ratio:.2f}x ({verdict(ratio >= 1.1)})")
    ratio = medians[BYTE_SIZED] / full
    print(f"   {BYTE_SIZED}: {medians[BYTE_SIZED]:.2f} tok/s, {ratio:.2f}x DynamicCache "
          f"({verdict(ratio >= 0.9)}; target: 0.9x DynamicCache)")  # fmt: skip
    for name in ("CompressedCache kv_bits=8", "CompressedCache kv_bits=4"):
        print(f"   {name}: {medians[name]:.2f} tok/s, {medians[name] / ours:.2f}x CompressedCache, "
              f"{medians[name] / full:.2f}x DynamicCache (every layer's codes read at every step)")  # fmt: skip
    shares = {
        "CompressedCache scoring=reconstruction": "layers and KV heads share the budget, allocation='heads'",
        "CompressedCache scoring=reconstruction, layers": "layers share the budget, allocation='layers'",
    }
    for name, how in shares.items():
        shared = medians[name]
        print(f"   CompressedCache scoring='reconstruction' ({how}): {shared:.2f} "
              f"tok/s, {shared / ours:.2f}x CompressedCache, {shared / full:.2f}x DynamicCache")  # fmt: skip


def long_generation(model, tokenizer, args) -> None:
    batch = encode_prompts(tokenizer, ["Write a very long story about a journey across the sea."])
    prompt = batch["input_ids"].to(model.device)
    full = decode(model, prompt, DynamicCache(), args.long_tokens)
    cache = CompressedCache(model, budget=args.long_budget)
    ours = decode(model, prompt, cache, args.long_tokens, track_held=True)
    held, ratio = max(ours.held), ours.tokens_per_second() / full.tokens_per_second()
    print(f"\n4. {args.long_tokens} new tokens under a {args.long_budget}-token budget")
    print(f"   most tokens held at any step: {held} ({verdict(held <= args.long_budget)}); at the end {ours.held[-1]}")
    print(f"   CompressedCache {ours.tokens_per_second():.2f} tok/s, full cache {full.tokens_per_second():.2f} tok/s")
    print(f"   CompressedCache / full cache tokens/s: {ratio:.2f}x ({verdict(ratio >= 1.0)})")


def peak_through_generate(model, tokenizer, args) -> None:
    ids = tokenizer(PROTOCOL_TEXTS["gpl3"][1](), add_special_tokens=False)["input_ids"][: args.prefill_tokens]
    chunks = [int(chunk) for chunk in args.peak_chunks.split(",")]
    peak_bytes.run(model, torch.tensor([ids], device=model.device), args.peak_new_tokens, chunks, verdict)


def shaped_model(shape: str, device: torch.device) -> LlamaForCausalLM:
    """A random-weight Llama of the given shape, built directly on ``device`` (bf16 on CUDA)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=131072, tie_word_embeddings=True)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def _prefill(model, prompt, cache, cuda: bool) -> tuple[float, float]:
    """Seconds and peak MiB above what was allocated before (NaN off CUDA) of one prefill into ``cache``."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    started = time.perf_counter()
    with torch.no_grad():
        model(prompt, past_key_values=cache, logits_to_keep=1)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return seconds, (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")


def host_bound_mode(args) -> None:
    model = shaped_model("host-bound", torch.device("cpu"))
    prompt = torch.randint(0, SHAPES["host-bound"]["vocab_size"], (1, args.host_prompt),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    budget = max(args.host_prompt // 4, 36)  # a quarter of the prompt, never below the sinks and recent window
    # The full caches run on a copy that no CompressedCache ever bound, as they run for a user without decodekit
    # (a bound model's attention modules call one wrapper more, which returns at once for other caches).
    plain = copy.deepcopy(model)
    caches = {
        "DynamicCache": (plain, DynamicCache),
        "  DynamicCache, model bound": (model, DynamicCache),
        f"CompressedCache(budget={budget})": (model, lambda: CompressedCache(model, budget=budget)),
        "  eviction_interval=1": (model, lambda: CompressedCache(model, budget=budget, eviction_interval=1)),
        "  kv_bits=8": (model, lambda: CompressedCache(model, budget=budget, kv_bits=8)),
        "  kv_bits=4": (model, lambda: CompressedCache(model, budget=budget, kv_bits=4)),
        "  memory_fraction=0.25, reconstruction": (model, lambda: byte_sized_cache(model)),
    }
    rates = {name: [] for name in caches}
    decode(plain, prompt, DynamicCache(), 8)  # warm-up
    for _ in range(args.host_rounds):
        for name, (runs_on, make) in caches.items():
            rates[name].append(decode(runs_on, prompt, make(), args.host_tokens).tokens_per_second())
    medians = {name: statistics.median(values) for name, values in rates.items()}
    full = medians["DynamicCache"]
    print(f"host-bound mode: {SHAPES['host-bound']['num_hidden_layers']} layers, hidden size 64, on the CPU; "
          f"{args.host_prompt}-token prompt, {args.host_tokens} greedy tokens, median of {args.host_rounds} "
          "interleaved rounds")  # fmt: skip
    for name, rate in medians.items():
        print(f"   {name:<40} {rate:8.1f} tok/s   {rate / full:.2f}x DynamicCache")
    ratio = medians[f"CompressedCache(budget={budget})"] / full
    print(f"   CompressedCache / DynamicCache tokens/s, host-bound: {ratio:.2f}x ({verdict(ratio >= 0.95)})")
    ratio = medians["  memory_fraction=0.25, reconstruction"] / full
    print(f"   byte-sized CompressedCache / DynamicCache tokens/s, host-bound: {ratio:.2f}x ({verdict(ratio >= 0.8)}; "
          "target 0.8x)")  # fmt: skip
    if args.host_compile:
        compiled_mode(plain, model, prompt, budget, args)


def loop_decode(model, forward, prompt: torch.Tensor, cache, new_tokens: int) -> float:
    """Greedy decoding by hand (the prompt's pass eager, each step through ``forward``); tokens/s of the steps."""
    with torch.no_grad():
        token = model(prompt, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(dim=-1)
        if prompt.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for step in range(new_tokens):
            position = torch.tensor([[prompt.shape[1] + step]], device=prompt.device)
            logits = forward(token, past_key_values=cache, position_ids=position, cache_position=position[0]).logits
            token = logits[:, -1:].argmax(dim=-1)
        token.cpu()
    return new_tokens / (time.perf_counter() - started)


def own_compiled(module: torch.nn.Module, tag: str, **options):
    """``torch.compile(module.forward, **options)`` through a copy of the forward function with a code object of its
    own, named ``tag``. Dynamo keeps its graphs per code object, and every model's ``forward`` shares one (as does the
    automatic dynamic shapes' record, by the code's name): variants compiled side by side in one process would check
    each other's guards at every step, before their own, and a full cache's growing keys would have the next
    variant's shapes compiled dynamic. Compiled this way, each runs as a program that decodes with one cache type."""
    function = module.forward.__func__
    code = function.__code__
    own = types.FunctionType(
        code.replace(co_name=f"{code.co_name}_{tag}"), function.__globals__, function.__name__,
        function.__defaults__, function.__closure__,
    )  # fmt: skip
    own.__kwdefaults__ = function.__kwdefaults__
    return torch.compile(types.MethodType(own, module), **options)


def compiled_mode(plain, model, prompt: torch.Tensor, budget: int, args) -> None:
    """Eager and ``torch.compile(model.forward)`` (inductor) decoding, by hand, for DynamicCache and StaticCache (on
    ``plain``, a copy of the model that decodekit never bound) and CompressedCache evicting one token per step (the
    setting that compiles to one graph) or at its default interval (four graphs)."""
    # Steps decoded once through each compiled forward before any timing: past the first eviction at the default
    # interval, whose step after an eviction compiles a graph of its own.
    warm_up = 16
    length = prompt.shape[1] + max(args.host_tokens, warm_up)  # StaticCache's room: every step of a round
    ours_name = f"CompressedCache(budget={budget}, eviction_interval=1)"
    caches = {
        "DynamicCache": (plain, DynamicCache),
        "StaticCache": (plain, lambda: StaticCache(config=plain.config, max_cache_len=length)),
        ours_name: (model, lambda: CompressedCache(model, budget=budget, eviction_interval=1)),
        f"CompressedCache(budget={budget}), default interval": (model, lambda: CompressedCache(model, budget=budget)),
        f"CompressedCache(budget={budget}, eviction_interval=1, kv_bits=4)": (
            model, lambda: CompressedCache(model, budget=budget, eviction_interval=1, kv_bits=4)
        ),
    }  # fmt: skip
    forwards = {
        name: {"eager": runs_on.forward, "compiled": own_compiled(runs_on, f"variant{index}", fullgraph=True)}
        for index, (name, (runs_on, _)) in enumerate(caches.items())
    }
    for name, (runs_on, make) in caches.items():  # compile (and warm up) before any timing
        loop_decode(runs_on, forwards[name]["compiled"], prompt, make(), warm_up)
    rates = {(name, mode): [] for name in caches for mode in ("eager", "compiled")}
    for _ in range(args.host_rounds):
        for (name, mode), values in rates.items():
            runs_on, make = caches[name]
            values.append(loop_decode(runs_on, forwards[name][mode], prompt, make(), args.host_tokens))
    medians = {key: statistics.median(values) for key, values in rates.items()}
    static = medians[("StaticCache", "compiled")]
    print(f"compiled: torch.compile(model.forward, fullgraph=True), inductor; the same prompt, {args.host_tokens} "
          f"greedy steps by hand, median of {args.host_rounds} interleaved rounds")  # fmt: skip
    for name in caches:
        eager, compiled = medians[(name, "eager")], medians[(name, "compiled")]
        print(f"   {name:<52} eager {eager:7.1f} tok/s   compiled {compiled:7.1f} tok/s   "
              f"{compiled / static:.2f}x StaticCache compiled")  # fmt: skip
    best = max((name for name in caches if name.startswith("CompressedCache")), key=lambda n: medians[(n, "compiled")])
    ours = medians[(best, "compiled")]
    print(f"   CompressedCache compiled / StaticCache compiled: {ours / static:.2f}x, {best} "
          f"({verdict(ours >= static)})")  # fmt: skip


# The compiled table's rows, as ``--gpu-compiled-caches`` names them.
COMPILED_ROWS = ("static", "interval1", "default", "interval1-4bit")


def gpu_compiled(plain, model, args, lengths: list[int]) -> None:
    """GPU mode's compiled decoding: ``torch.compile(model.forward, fullgraph=True)`` in each of
    ``--gpu-compile-modes`` for transformers' StaticCache (on ``plain``, a copy of the model that decodekit never
    bound, with room for the prompt and every step) and a CompressedCache holding a quarter of the prompt that
    evicts one token per step (whose steps after the first two run one graph that CUDA graphs can replay) or at its
    default interval (four graphs; not under CUDA graphs), beside eager; greedy steps by hand, the median of
    ``--gpu-rounds`` runs after one that compiles. A mode whose CUDA graphs were skipped says so."""
    torch._dynamo.config.recompile_limit = 64
    modes = [mode for mode in args.gpu_compile_modes.split(",") if mode]
    device = next(model.parameters()).device
    backend = args.gpu_compile_backend
    how = f"in modes {', '.join(modes)}" if backend == "inductor" else f"with backend {backend}"
    print(f"\ncompiled decoding: torch.compile(model.forward, fullgraph=True) {how}; "
          f"{args.gpu_tokens} greedy steps by hand, median of {args.gpu_rounds} after a compiling run")  # fmt: skip
    print(f"   {'length':>7s} {'cache':44s}{'mode':>16s}{'tok/s':>9s}{'vs Static':>10s}{'cache MiB':>11s}")
    for length in lengths:
        prompt = torch.randint(0, model.config.vocab_size, (1, length), device=device)
        room = length + args.gpu_tokens + 16
        caches = {
            "StaticCache": (plain, lambda room=room: StaticCache(config=plain.config, max_cache_len=room)),
            f"CompressedCache(budget={length // 4}, eviction_interval=1)": (
                model, lambda length=length: CompressedCache(model, budget=length // 4, eviction_interval=1)
            ),
            f"CompressedCache(budget={length // 4}), default interval": (
                model, lambda length=length: CompressedCache(model, budget=length // 4)
            ),
            f"CompressedCache(budget={length // 4}, eviction_interval=1, kv_bits=4)": (
                model, lambda length=length: CompressedCache(model, budget=length // 4, eviction_interval=1, kv_bits=4)
            ),
        }  # fmt: skip
        rows = dict(zip(COMPILED_ROWS, caches, strict=True))
        chosen = [rows[row.strip()] for row in args.gpu_compiled_caches.split(",")]
        results = {}
        for name, (runs_on, make) in ((name, caches[name]) for name in chosen):
            # Past one eviction per step, a step's graph takes counts that change between steps (the waiting steps,
            # the stored entries), for each of which CUDA graphs would record anew: those rows run without them.
            multi_step = "eviction_interval=1" not in name and name != "StaticCache"
            for mode in ("eager", *(mode for mode in modes if not (multi_step and mode == "reduce-overhead"))):
                forward = runs_on.forward if mode == "eager" else compiled_forward(runs_on, mode, backend)
                try:
                    loop_decode(runs_on, forward, prompt, make(), 16)  # compiles (four graphs at most), warms up
                    rates, cache = [], None
                    for _ in range(args.gpu_rounds):
                        cache = make()
                        rates.append(loop_decode(runs_on, forward, prompt, cache, args.gpu_tokens))
                    results[(name, mode)] = (statistics.median(rates), cache_bytes(cache) / 2**20)
                    skipped = counters["inductor"]["cudagraph_skips"]
                    if mode == "reduce-overhead" and skipped:
                        print(f"   {length:7d} {name:44s}{mode:>16s}  CUDA graphs skipped {skipped} time(s)")
                except Exception as error:  # a mode that fails is reported, not fatal to the run
                    print(f"   {length:7d} {name:44s}{mode:>16s}  failed: {type(error).__name__}: {error}"[:400])
                torch._dynamo.reset()
                counters.clear()
        for (name, mode), (rate, size) in results.items():
            static = results.get(("StaticCache", mode), (float("nan"), 0))[0]
            label = mode if mode == "eager" or backend == "inductor" else f"backend={backend}"
            print(f"   {length:7d} {name:44s}{label:>16s}{rate:9.1f}{rate / static:9.2f}x{size:11.1f}")


def compiled_forward(model, mode: str, backend: str):
    """``model.forward`` compiled for a row of the compiled table: by inductor in ``mode``, or by ``backend``."""
    options = {"mode": mode} if backend == "inductor" else {"backend": backend}
    return torch.compile(model.forward, fullgraph=True, **options)


def gpu_mode(args, device: torch.device) -> None:
    model = shaped_model(args.shape, device)
    # The full caches' compiled decoding runs on a copy that no CompressedCache ever bound.
    plain = copy.deepcopy(model) if args.gpu_compile_modes else None
    if args.gpu_eager:
        gpu_eager(model, args, device)
    if args.gpu_compile_modes:
        gpu_compiled(plain, model, args, [int(value) for value in args.lengths.split(",")])


def gpu_eager(model, args, device: torch.device) -> None:
    """GPU mode's eager table: prefill time and peak memory, decoding through ``generate`` and cache size."""
    cuda = device.type == "cuda"
    candidates = {
        "DynamicCache": lambda length: DynamicCache(),
        "CompressedCache": lambda length: CompressedCache(model, budget=length // 4),
        "CompressedCache eviction_interval=8": lambda length: CompressedCache(
            model, budget=length // 4, eviction_interval=8
        ),
        "CompressedCache scoring_backend='torch'": lambda length: CompressedCache(
            model, budget=length // 4, scoring_backend="torch"
        ),
        "CompressedCache observation_window=64": lambda length: CompressedCache(
            model, budget=length // 4, observation_window=64
        ),
        "CompressedCache bytes 0.25 (estimate)": lambda length: byte_sized_cache(model),
        "CompressedCache bytes 0.25, replay pass": lambda length: byte_sized_cache(model, replay="forward"),
        "CompressedCache bytes 0.1, replay+refit": lambda length: CompressedCache(
            model, memory_fraction=0.1, scoring="reconstruction"
        ),
    }
    if args.gpu_caches:
        chosen = {name.strip() for name in args.gpu_caches.split(",")}
        unknown = chosen - set(candidates)
        if unknown:
            raise SystemExit(f"--gpu-caches: unknown {sorted(unknown)}; choose from {sorted(candidates)}")
        candidates = {name: make for name, make in candidates.items() if name in chosen or name == "DynamicCache"}
    scoring = "Triton kernels" if cuda and importlib.util.find_spec("triton") else "blocked PyTorch"
    print(f"{args.shape}-shaped random model on {device}, batch 1, 25% budget; median of {args.gpu_rounds} prefills"
          f" after a warm-up; decode: {args.gpu_tokens} greedy tokens; default scoring: {scoring}")  # fmt: skip
    print(
        "   decode: tokens/s of the first generation through each length (cold: on CUDA, attention kernels may"
        " plan each new shape)"
    )
    print(f"   and the median of {args.gpu_decode_rounds} more (warm), in interleaved rounds, at batch 1, and warm at"
          f" batch {args.gpu_batch}")  # fmt: skip
    print(f"   {'length':>7s} {'cache':40s}{'prefill s':>10s}{'vs full':>8s}{'peak MiB':>10s}{'vs full':>8s}"
          f"{'cold':>8s}{'warm':>8s}{'vs full':>8s}{'batch':>8s}{'vs full':>8s}{'cache MiB':>10s}")  # fmt: skip
    warm_up = torch.randint(0, model.config.vocab_size, (1, 1024), device=device)
    for make in candidates.values():  # kernel compilation and library start-up stay out of the timings
        _prefill(model, warm_up, make(1024), cuda)
        decode(model, warm_up[:, :256], make(256), 4)
    for length in (int(value) for value in args.lengths.split(",")):
        if length // 4 < 36:
            raise SystemExit(f"--lengths: {length} is too short for a 25% budget (at least 144 tokens)")
        prompt = torch.randint(0, model.config.vocab_size, (1, length), device=device)
        active = {name: make for name, make in candidates.items() if "scoring_backend" not in name or length <= 8192}
        # (the PyTorch scoring path's prefill takes seconds per run beyond 8k: 29x DynamicCache's at 32k on an H100)
        measured = {}
        for name, make in active.items():
            runs = []
            for _ in range(args.gpu_rounds):
                cache = make(length)
                runs.append(_prefill(model, prompt, cache, cuda))
            measured[name] = (statistics.median(seconds for seconds, _ in runs), max(peak for _, peak in runs),
                              cache_bytes(cache) / 2**20)  # fmt: skip
            del cache
        # Decoding in interleaved rounds, each cache once per round, so that a slow spell of the host hits all
        # alike; the first round is the cold one. The PyTorch path's batched prefill is too slow to be worth it.
        wide_names = [name for name in active if "scoring_backend" not in name] if args.gpu_batch else []
        rates = {name: [] for name in active}
        wides = {name: [] for name in wide_names}
        batched = prompt.expand(max(args.gpu_batch, 1), -1)
        for _ in range(1 + args.gpu_decode_rounds):
            for name, make in active.items():
                rates[name].append(decode(model, prompt, make(length), args.gpu_tokens).tokens_per_second())
            for name in wide_names:
                wides[name].append(decode(model, batched, active[name](length), args.gpu_tokens).tokens_per_second())
        results = {}
        for name, (prefill, peak, size) in measured.items():
            warm = statistics.median(rates[name][1:])
            wide = statistics.median(wides[name][1:]) * args.gpu_batch if name in wides else float("nan")
            results[name] = (prefill, peak, rates[name][0], warm, wide, size)
        full = results["DynamicCache"]
        for name, (prefill, peak, cold, warm, wide, size) in results.items():
            peak_ratio = peak / full[1] if cuda else float("nan")
            print(f"   {length:7d} {name:40s}{prefill:10.3f}{prefill / full[0]:7.2f}x{peak:10.0f}{peak_ratio:7.2f}x"
                  f"{cold:8.1f}{warm:8.1f}{warm / full[3]:7.2f}x{wide:8.1f}{wide / full[4]:7.2f}x"
                  f"{size:10.1f}")  # fmt: skip
        if "CompressedCache" not in results:
            continue
        prefill, peak, _, warm, _, size = results["CompressedCache"]
        full_prefill, full_peak, _, full_warm, _, full_size = full
        memory = f"{peak / full_peak:.2f}x ({verdict(peak <= full_peak)} <= 1.0x)" if cuda else "not measured"
        print(f"   {length:7d} targets: prefill {prefill / full_prefill:.2f}x ({verdict(prefill <= 1.3 * full_prefill)}"
              f" <= 1.3x), peak memory {memory}, warm decode {warm / full_warm:.2f}x"
              f" ({verdict(warm >= (1.5 if length >= 32768 else 1.0) * full_warm)}"
              f" >= {'1.5x at 32k' if length >= 32768 else '1.0x'})")  # fmt: skip
        weights = weight_bytes_read(model) / 2**20
        ceiling = memory_bound_ceiling(weights, full_size, size)
        print(f"   {length:7d} a step reads {weights:.0f} MiB of weights, and {full_size:.0f} MiB of DynamicCache's"
              f" cache against {size:.0f} MiB of ours: moving every byte at one rate, it decodes"
              f" at most {ceiling:.2f}x as fast as DynamicCache")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--context-tokens", type=int, default=3072)
    parser.add_argument("--continuation-tokens", type=int, default=512)
    parser.add_argument("--pass-keys", type=int, default=10, help="pass-key tasks per ratio")
    parser.add_argument("--pass-key-filler", type=int, default=80, help="filler sentences (80: about 2k tokens)")
    parser.add_argument("--prefill-tokens", type=int, default=3072)
    parser.add_argument("--prefill-rounds", type=int, default=3)
    parser.add_argument("--speed-prompt", type=int, default=4096)
    parser.add_argument("--speed-tokens", type=int, default=256)
    parser.add_argument("--speed-rounds", type=int, default=1)
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--long-budget", type=int, default=256)
    parser.add_argument(
        "--texts",
        type=protocol_texts,
        default=PROTOCOL_TEXTS,
        help=f"quality: the protocol's texts to measure, comma-separated (default: all of {', '.join(PROTOCOL_TEXTS)})",
    )
    parser.add_argument("--skip-quality", action="store_true", help="measure cost and speed only")
    parser.add_argument("--skip-equal-tokens", action="store_true", help="skip the quality section at equal tokens")
    parser.add_argument("--skip-bytes", action="store_true", help="skip the quality-per-byte section")
    parser.add_argument(
        "--byte-shares",
        default=",".join(map(str, per_byte.BYTE_SHARES)),
        help="quality per byte: shares of the full 16-bit cache's bytes removed",
    )
    parser.add_argument("--retrieval-tasks", type=int, default=10, help="quality per byte: retrieval tasks per kind")
    parser.add_argument("--retrieval-tokens", type=int, default=2000, help="quality per byte: retrieval context")
    parser.add_argument(
        "--byte-presses",
        default="KVzip,AdaKV(SnapKV),SnapKV",
        help="quality per byte: the kvpress presses measured at each share",
    )
    parser.add_argument("--byte-presses-from", help="quality per byte: a JSONL file of press results")
    parser.add_argument("--save-byte-presses", help="quality per byte: keep the presses measured now in this file")
    parser.add_argument("--skip-speed", action="store_true", help="measure quality only")
    parser.add_argument("--only-peak", action="store_true", help="measure the peak bytes through generate only")
    parser.add_argument("--peak-chunks", default="512,2048", help="section 5's prefill chunks, comma-separated")
    parser.add_argument("--peak-new-tokens", type=int, default=256, help="section 5's new tokens")
    parser.add_argument("--skip-kvpress", action="store_true", help="compare with the full cache only")
    parser.add_argument("--presses-from", help="a JSONL file of press results from an earlier kvpress run")
    parser.add_argument("--kvpress-python", help="python of a virtualenv that has kvpress installed")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="GPU mode: a random model of this shape")
    parser.add_argument("--lengths", default="8192,32768", help="GPU mode: prompt lengths")
    parser.add_argument("--gpu-tokens", type=int, default=128, help="GPU mode: tokens decoded per measurement")
    parser.add_argument("--gpu-rounds", type=int, default=3, help="GPU mode: prefills timed per cache (median)")
    parser.add_argument("--gpu-batch", type=int, default=8, help="GPU mode: rows of the batched decode (0: none)")
    parser.add_argument("--gpu-decode-rounds", type=int, default=5, help="GPU mode: warm interleaved decode rounds")
    parser.add_argument(
        "--gpu-compile-modes", default=None,
        help="GPU mode: torch.compile modes for compiled decoding, comma-separated, '' for none "
             "(default: 'default,reduce-overhead' on CUDA, none elsewhere)",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-compile-backend", default="inductor",
        help="GPU mode: torch.compile's backend for compiled decoding; another than inductor (eager, aot_eager: "
             "to check the section's code without inductor's compile time) takes the one mode 'default'",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-eager", action=argparse.BooleanOptionalAction, default=True,
        help="GPU mode: the eager table (prefill, memory, decoding through generate)",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-caches", default=None,
        help="GPU mode: the eager table's rows to measure, comma-separated names (default: all; DynamicCache always)",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-compiled-caches", default=",".join(COMPILED_ROWS),
        help="GPU mode: the compiled table's rows, comma-separated: static (StaticCache), interval1 "
             "(CompressedCache with eviction_interval=1), default (at its default interval), interval1-4bit "
             "(eviction_interval=1 with kv_bits=4)",
    )  # fmt: skip
    parser.add_argument("--host-bound", action="store_true", help="the host-bound CPU mode only")
    parser.add_argument("--host-prompt", type=int, default=512, help="host-bound mode: prompt tokens")
    parser.add_argument("--host-tokens", type=int, default=128, help="host-bound mode: tokens decoded per round")
    parser.add_argument("--host-rounds", type=int, default=5, help="host-bound mode: interleaved rounds")
    parser.add_argument(
        "--host-compile", action=argparse.BooleanOptionalAction, default=True,
        help="host-bound mode: also decode through torch.compile (inductor; a few minutes of compiling)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    device = torch.device(args.device)
    if args.gpu_compile_modes is None:
        args.gpu_compile_modes = "default,reduce-overhead" if device.type == "cuda" else ""
    if args.gpu_compile_backend != "inductor" and args.gpu_compile_modes not in ("", "default"):
        parser.error(f"--gpu-compile-modes: with --gpu-compile-backend {args.gpu_compile_backend} only 'default' "
                     f"(inductor's modes); got {args.gpu_compile_modes!r}")  # fmt: skip
    unknown = {row.strip() for row in args.gpu_compiled_caches.split(",")} - set(COMPILED_ROWS)
    if unknown:
        raise SystemExit(f"--gpu-compiled-caches: unknown {sorted(unknown)}; choose from {', '.join(COMPILED_ROWS)}")
    if args.host_bound:
        host_bound_mode(args)
        return
    if args.shape:
        gpu_mode(args, device)
        return
    model, tokenizer = load_model(device_map=str(device) if device.type != "cpu" else None)
    if args.only_peak:
        peak_through_generate(model, tokenizer, args)
        return
    if not (args.skip_quality or args.skip_equal_tokens):
        quality(model, tokenizer, args)
    if not (args.skip_quality or args.skip_bytes):
        texts = text_tasks(tokenizer, args.texts, args.context_tokens, args.continuation_tokens)
        per_byte.run(model, tokenizer, texts, args, byte_press_rows(args, model), verdict)
    if not args.skip_speed:
        prefill_cost(model, tokenizer, args)
        speed(model, tokenizer, args)
        long_generation(model, tokenizer, args)
        peak_through_generate(model, tokenizer, args)


if __name__ == "__main__":
    main()
