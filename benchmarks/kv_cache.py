"""decodekit's CompressedCache against the full cache and NVIDIA's kvpress presses.

    python benchmarks/kv_cache.py [--skip-kvpress] [--kvpress-python PATH]

Prints, measured side by side in one run on the default model:
  1. quality: perplexity of a 512-token continuation given a 3072-token context of real text
     (the standard library's data-model documentation), the context prefilled through each
     compressed cache, at 50% and 75% compression; ours against the full cache and against
     kvpress's SnapKV, TOVA, ObservedAttention, StreamingLLM and Knorm presses at the same
     number of kept tokens              (target: lower perplexity than every press, both ratios)
  2. memory: bytes held after that prefill at 75% compression / the full cache's  (target <= 27%)
  3. speed: tokens/s decoding 256 tokens after a 4096-token prompt, 25% budget / DynamicCache
                                                                                  (target >= 1.1x)
  4. long generation: 2048 new tokens under a 256-token budget: the most tokens held at any
     step, and tokens/s against the full cache

kvpress 0.5.5 pins transformers < 5.3, so it runs in its own virtualenv: --kvpress-python, else
$KVPRESS_PYTHON, else .venv-kvpress/ (created with torch==2.13.0 and kvpress==0.5.5 if missing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _timing import verdict  # benchmarks/ is on sys.path when a script in it runs
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from decodekit import encode_prompts, load_model
from decodekit.cache import CompressedCache
from decodekit.eval.perplexity import continuation_perplexity

ROOT = Path(__file__).resolve().parent.parent
RATIOS = (0.5, 0.75)
KVPRESS_VENV = ROOT / ".venv-kvpress"


def long_text_ids(tokenizer, count: int) -> list[int]:
    """``count`` tokens of real text that ships with Python: the data-model and statements chapters."""
    from pydoc_data.topics import topics

    ids = tokenizer(topics["specialnames"] + "\n\n" + topics["compound"])["input_ids"]
    if len(ids) < count:
        raise ValueError(f"the reference text has {len(ids)} tokens; {count} were asked for")
    return ids[:count]


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


def run_kvpress(python: Path, model_dir: str, context: list[int], continuation: list[int]) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        tokens = Path(directory) / "tokens.json"
        tokens.write_text(json.dumps({"context": context, "continuation": continuation}))
        command = [str(python), str(Path(__file__).parent / "_kvpress_runner.py"), model_dir, str(tokens)]
        result = subprocess.run(command + [str(r) for r in RATIOS], capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"kvpress run failed:\n{result.stderr[-3000:]}")
    printed = json.loads(result.stdout.splitlines()[-1])
    return {name: {float(ratio): ppl for ratio, ppl in values.items()} for name, values in printed.items()}


def quality_and_memory(model, tokenizer, args) -> None:
    ids = long_text_ids(tokenizer, args.context_tokens + args.continuation_tokens)
    context = torch.tensor([ids[: args.context_tokens]])
    continuation = torch.tensor([ids[args.context_tokens :]])
    full_cache = DynamicCache()
    full = continuation_perplexity(model, full_cache, context, continuation)
    rows = {"full cache": dict.fromkeys(RATIOS, full)}
    caches = {ratio: CompressedCache(model, compression_ratio=ratio) for ratio in RATIOS}
    rows["decodekit CompressedCache"] = {
        ratio: continuation_perplexity(model, cache, context, continuation) for ratio, cache in caches.items()
    }
    python = kvpress_python(args)
    if python is not None:
        presses = run_kvpress(python, model.name_or_path, ids[: args.context_tokens], ids[args.context_tokens :])
        rows.update({f"kvpress {name}": values for name, values in presses.items()})
    print(
        f"1. perplexity of a {args.continuation_tokens}-token continuation after a {args.context_tokens}-token context"
    )
    print(f"   {'method':34s}" + "".join(f"{f'{r:.0%} evicted':>14s}{'vs full':>10s}" for r in RATIOS))
    for name, values in rows.items():
        cells = "".join(f"{values[r]:14.3f}{(values[r] / full - 1):+10.1%}" for r in RATIOS)
        print(f"   {name:34s}{cells}")
    ours = rows["decodekit CompressedCache"]
    presses = {name: values for name, values in rows.items() if name.startswith("kvpress")}
    if presses:
        wins = all(ours[r] < values[r] for values in presses.values() for r in RATIOS)
        print(f"   lower than every kvpress press at both ratios: {wins} ({verdict(wins)})")
    else:
        print("   kvpress skipped")
    share = cache_bytes(caches[0.75]) / cache_bytes(full_cache)
    print(f"\n2. memory after the prefill at 75% compression: {share:.1%} of the full cache ({verdict(share <= 0.27)})")


class _StepClock(LogitsProcessor):
    """Records when each step's scores arrive, and how many tokens the cache holds then."""

    def __init__(self, cache=None):
        self.cache, self.times, self.held = cache, [], []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        if isinstance(self.cache, CompressedCache):
            self.held.append(max(layer.kept for layer in self.cache.layers))
        return scores

    def tokens_per_second(self) -> float:
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])


def decode(model, input_ids, cache, new_tokens: int) -> _StepClock:
    clock = _StepClock(cache)
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
    prompt = torch.tensor([long_text_ids(tokenizer, args.speed_prompt)])
    budget = args.speed_prompt // 4
    rates = {"DynamicCache": [], "CompressedCache": []}
    for _ in range(args.speed_rounds):
        rates["DynamicCache"].append(decode(model, prompt, DynamicCache(), args.speed_tokens).tokens_per_second())
        cache = CompressedCache(model, budget=budget)
        rates["CompressedCache"].append(decode(model, prompt, cache, args.speed_tokens).tokens_per_second())
    full, ours = (sorted(values)[len(values) // 2] for values in rates.values())
    ratio = ours / full
    print(f"\n3. decoding {args.speed_tokens} tokens after a {args.speed_prompt}-token prompt, budget {budget} (25%)")
    print(f"   DynamicCache {full:.2f} tok/s, CompressedCache {ours:.2f} tok/s (median of {args.speed_rounds})")
    print(f"   CompressedCache / DynamicCache tokens/s: {ratio:.2f}x ({verdict(ratio >= 1.1)})")


def long_generation(model, tokenizer, args) -> None:
    batch = encode_prompts(tokenizer, ["Write a very long story about a journey across the sea."])
    prompt = batch["input_ids"]
    full = decode(model, prompt, DynamicCache(), args.long_tokens)
    cache = CompressedCache(model, budget=args.long_budget)
    ours = decode(model, prompt, cache, args.long_tokens)
    held = max(ours.held)
    print(f"\n4. {args.long_tokens} new tokens under a {args.long_budget}-token budget")
    print(f"   most tokens held at any step: {held} ({verdict(held <= args.long_budget)}); at the end {ours.held[-1]}")
    print(f"   CompressedCache {ours.tokens_per_second():.2f} tok/s, full cache {full.tokens_per_second():.2f} tok/s")
    print(f"   CompressedCache / full cache tokens/s: {ours.tokens_per_second() / full.tokens_per_second():.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-tokens", type=int, default=3072)
    parser.add_argument("--continuation-tokens", type=int, default=512)
    parser.add_argument("--speed-prompt", type=int, default=4096)
    parser.add_argument("--speed-tokens", type=int, default=256)
    parser.add_argument("--speed-rounds", type=int, default=1)
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--long-budget", type=int, default=256)
    parser.add_argument("--skip-kvpress", action="store_true", help="compare with the full cache only")
    parser.add_argument("--kvpress-python", help="python of a virtualenv that has kvpress installed")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    quality_and_memory(model, tokenizer, args)
    speed(model, tokenizer, args)
    long_generation(model, tokenizer, args)


if __name__ == "__main__":
    main()
