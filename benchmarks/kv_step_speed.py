"""Decoding speed of byte-sized caches in given widths against generate's own cache, on any model, side by side.

Each cache decodes greedily after the same prompt; a step's time is that of ``generate`` with ``new + 1`` tokens
less that with 1 (the prompt's pass and its compression cancel), the best of ``--rounds`` rounds, the caches taken
in turn within each round. The ratio is DynamicCache's time per step over the cache's (tokens/s against
DynamicCache's)::

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/kv_step_speed.py --model gemma-3-270m-q4_k_m.gguf \
        --fraction 0.1 --bits model,5/4
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from transformers import DynamicCache

from decodekit.cache import CompressedCache
from decodekit.models import load_model
from decodekit.settings import KV_BITS


def widths(spelled: str) -> list[dict]:
    """Comma-separated widths, each ``model`` (the cache's own choice) or ``K/V`` (keys and values in those bits), as
    CompressedCache keywords; argparse's error for anything else.

    Example:
        >>> widths("model,5/4")
        [{}, {'key_bits': 5, 'kv_bits': 4}]
    """
    chosen = []
    for part in spelled.split(","):
        keys, _, values = part.partition("/")
        if part == "model":
            chosen.append({})
        elif keys.isdigit() and values.isdigit() and {int(keys), int(values)} <= set(KV_BITS):
            chosen.append({"key_bits": int(keys), "kv_bits": int(values)})
        else:
            allowed = ", ".join(map(str, KV_BITS))
            raise argparse.ArgumentTypeError(f"each width is model or K/V with K and V in {allowed}; got {part!r}")
    return chosen


def fraction(spelled: str) -> float:
    """A memory fraction in (0, 1]; argparse's error for anything else."""
    try:
        value = float(spelled)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a memory fraction in (0, 1]; got {spelled!r}")
    return value


def seconds_per_step(model, prompt: torch.Tensor, make, new_tokens: int) -> float:
    """The time of one decoding step with the cache ``make()`` returns, after ``prompt``."""

    def run(tokens: int) -> float:
        cache = make()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                           max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)  # fmt: skip
        return time.perf_counter() - start

    return (run(new_tokens + 1) - run(1)) / new_tokens


def positive(spelled: str) -> int:
    """A whole number of at least 1; argparse's error for anything else."""
    if not spelled.isdigit() or int(spelled) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1; got {spelled!r}")
    return int(spelled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local model directory or .gguf file (default: the embedded model)")
    parser.add_argument("--fraction", type=fraction, default=0.1, help="memory_fraction of the compressed caches")
    parser.add_argument("--scoring", default="reconstruction")
    parser.add_argument("--bits", type=widths, default="model", help="comma-separated: model or K/V (keys/values)")
    parser.add_argument("--prompt-tokens", type=positive, default=3072)
    parser.add_argument("--new-tokens", type=positive, default=64)
    parser.add_argument("--rounds", type=positive, default=2)
    args = parser.parse_args()
    model, _ = load_model(args.model)
    prompt = torch.randint(100, min(20000, model.config.vocab_size), (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    makers = {"DynamicCache": lambda: DynamicCache(config=model.config)}
    for chosen in args.bits:
        options = {"memory_fraction": args.fraction, "scoring": args.scoring, **chosen}
        spelled = f"{chosen['key_bits']}/{chosen['kv_bits']}" if chosen else "model"
        makers[f"memory_fraction={args.fraction}, bits {spelled}"] = lambda options=options: CompressedCache(
            model, **options
        )
    best = {name: float("inf") for name in makers}
    for _ in range(args.rounds):
        for name, make in makers.items():
            best[name] = min(best[name], seconds_per_step(model, prompt, make, args.new_tokens))
    print(f"{args.model or 'default model'}: {args.prompt_tokens}-token prompt, {args.new_tokens} steps, best of "
          f"{args.rounds} rounds, {torch.get_num_threads()} thread(s)")  # fmt: skip
    for name, seconds in best.items():
        print(f"  {name:42s} {seconds * 1000:7.1f} ms/step  {best['DynamicCache'] / seconds:5.2f}x DynamicCache")


if __name__ == "__main__":
    main()
