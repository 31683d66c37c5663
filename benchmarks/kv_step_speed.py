"""Decoding speed of byte-sized caches in given widths against generate's own cache, on any model, side by side.

Each cache decodes greedily after the same prompt, timed step by step as ``kv_cache.py`` times its decoding (the
prompt's pass and its compression left out), the caches taken in turn within each round; the ratio is the cache's
median tokens/s over DynamicCache's::

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/kv_step_speed.py --model gemma-3-270m-q4_k_m.gguf \
        --fraction 0.1 --bits model,5/4
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
from kv_cache import decode  # benchmarks/ is on sys.path when a script in it runs
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
    rates = {name: [] for name in makers}
    for _ in range(args.rounds):  # interleaved, so that a slow spell of the machine hits every cache
        for name, make in makers.items():
            rates[name].append(decode(model, prompt, make(), args.new_tokens).tokens_per_second())
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(f"{args.model or 'default model'}: {args.prompt_tokens}-token prompt, {args.new_tokens} steps, median of "
          f"{args.rounds} rounds, {torch.get_num_threads()} thread(s)")  # fmt: skip
    for name, rate in medians.items():
        print(f"  {name:42s} {1000 / rate:7.1f} ms/step  {rate / medians['DynamicCache']:5.2f}x DynamicCache")


if __name__ == "__main__":
    main()
