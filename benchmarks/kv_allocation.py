"""Ablation: how the tokens a compressed cache keeps are shared out among layers and KV heads.

At equal tokens kept, on the tuning texts only (never the protocol's), the prompt is scored by
CompressedCache's default attention scoring (``--scoring attention``) or by its reconstruction
scores alone (``--scoring reconstruction``: the most attention any replay query pays a token, as
KVzip scores), then each allocation decides what every (layer, KV head) keeps, and the continuation
is scored over what was kept:

- uniform: every (layer, head) keeps the same share, its best-ranked tokens;
- per layer: a layer's heads share the layer's budget through one ranking (AdaKV);
- global: all layers and heads share one budget through one ranking (KVzip's allocation), on raw
  scores, or on scores divided by their layer's mean (so that layers with flat attention compete);
- layers: all layers share one budget, every head of a layer keeping the same number of tokens
  (``CompressedCache(allocation="global")``: ``decodekit.cache.allocation.layer_counts``);
- global, rectangular: the global ranking given only the memory of the even share in rectangular
  per-layer tensors (a layer as long as its longest head): the most tokens whose ranking fits, each
  head then filling up to its layer's length. Prints the memory the plain global ranking would need.

Non-uniform allocations keep a floor per head (each keeps at least ``--floor`` of the uniform share;
for "layers", each layer) and are applied as masks: this measures the quality of the choice, not the
memory. "layers" needs no more memory than "uniform" (each layer's storage holds only what it
keeps); "per layer" and "global" would need storage of a different length per head, or about 1.3x
to 2x the memory in a rectangular layout. Sinks and the recent window are always kept.

    python benchmarks/kv_allocation.py [--scoring attention|reconstruction] [--ratios 0.5,0.75,0.9] [--floor 0.2]
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics

import torch
from kv_protocol import add_tuning_texts_argument, text_tasks
from torch.nn import functional

from decodekit import load_model
from decodekit.cache import CompressedCache, EvictionPolicy
from decodekit.cache.allocation import layer_counts
from decodekit.cache.eviction import PROTECTED
from decodekit.cache.options import SizeOptions
from decodekit.eval.perplexity import continuation_perplexity as evicting_perplexity

ALLOCATIONS = ("uniform", "per layer", "global", "global, layer-normalized", "layers", "global, rectangular")


def _ranked(priority: torch.Tensor, keep: int) -> torch.Tensor:
    """A boolean mask over ``priority``'s last dimension keeping its ``keep`` largest entries per row."""
    mask = torch.zeros_like(priority, dtype=torch.bool)
    return mask.scatter_(-1, priority.topk(min(keep, priority.shape[-1]), dim=-1).indices, True)


def allocate(priorities: list[torch.Tensor], ratio: float, how: str, floor: float) -> list[torch.Tensor]:
    """Per layer, ``[kv_heads, tokens]`` masks of what each head keeps: ``1 - ratio`` of all entries in all."""
    heads, tokens = priorities[0].shape
    # A head's tokens under the uniform allocation, never under the cache's floor (its sinks and recent window),
    # which every layer keeps whatever its share, as the cache does.
    least = min(EvictionPolicy(SizeOptions(compression_ratio=ratio)).floor, tokens)
    share = max(math.ceil((1 - ratio) * tokens), least)
    if how == "uniform":
        return [_ranked(priority, share) for priority in priorities]
    if how == "layers":
        counts = layer_counts([priority[None] for priority in priorities], torch.tensor([share]), floor)
        counts = counts[:, 0].clamp(min=least)
        return [_ranked(priority, int(count)) for priority, count in zip(priorities, counts, strict=True)]
    protected_floor = math.ceil(floor * share)
    lifted = []  # every head's best ``protected_floor`` entries are kept whatever the ranking
    for priority in priorities:
        floor_mask = _ranked(priority, protected_floor)
        scores = priority.clone()
        if how == "global, layer-normalized":
            ordinary = scores < PROTECTED
            scores = torch.where(ordinary, scores / scores[ordinary].mean().clamp(min=1e-30), scores)
        lifted.append(torch.where(floor_mask, PROTECTED, scores))
    if how == "global, rectangular":
        return _rectangular(lifted, priorities, share, ratio)
    if how == "per layer":
        return [_ranked(scores.reshape(1, -1), heads * share).reshape(heads, tokens) for scores in lifted]
    return list(_global_masks(lifted, len(priorities) * heads * share))


def _global_masks(lifted: list[torch.Tensor], total: int) -> torch.Tensor:
    """``[layers, heads, tokens]``: the ``total`` best entries of all layers and heads together."""
    flat = torch.stack(lifted).reshape(1, -1)
    return _ranked(flat, total).reshape(len(lifted), *lifted[0].shape)


def _rectangular(lifted: list[torch.Tensor], priorities: list[torch.Tensor], share: int, ratio: float) -> list:
    """The global ranking within the memory of the even share in rectangular per-layer tensors."""
    layers, heads = len(lifted), lifted[0].shape[0]
    memory = layers * heads * share  # entries a rectangular layout holds at the even share

    def lengths(total: int) -> torch.Tensor:  # each layer's longest head under the global ranking
        return _global_masks(lifted, total).sum(dim=-1).amax(dim=-1)

    needed = int(lengths(memory).sum()) * heads / memory
    low, high = layers * share, memory  # the even share always fits; the whole memory may not
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if int(lengths(middle).sum()) * heads <= memory else (low, middle - 1)
    print(f"    {ratio:.0%} evicted: the plain global ranking needs {needed:.2f}x the memory", flush=True)
    return [_ranked(priority, int(length)) for priority, length in zip(priorities, lengths(low), strict=True)]


def scored_prompt(model, context, scoring: str = "attention", **options):
    """A cache that scored the whole ``context`` (by ``scoring``; ``options`` go to the cache) and evicted nothing,
    and the prefill's logits for the first continuation token."""
    # "global" ranks the reconstruction scores as they are.
    allocation = "global" if scoring == "reconstruction" else "uniform"
    if scoring == "reconstruction":  # a replay pass, unless the options say otherwise (replay="auto" would estimate)
        options = {"replay": "forward", **options}
    cache = CompressedCache(model, compression_ratio=0.0, scoring=scoring, allocation=allocation, **options)
    with torch.inference_mode():
        first_logits = model(context, past_key_values=cache).logits[:, -1:]
    cache.end_context()  # (the continuation is not part of the context)
    return cache, first_logits


def keep_only(layer, keep: torch.Tensor) -> None:
    """Keep only the entries ``keep`` marks (``[kv_heads, tokens]``, one row) in ``layer``: each head keeps its own
    number, in slot order (later passes are masked to each head's length)."""
    counts = keep.sum(dim=-1)
    slots = keep.to(torch.uint8).argsort(dim=-1, descending=True, stable=True)[:, : int(counts.max())]
    layer.storage.keep(slots[None], counts[None].numpy())


def masked_perplexity(model, scored, continuation, masks: list[torch.Tensor] | None) -> float:
    """The continuation's perplexity after a copy of a ``scored_prompt`` keeping only what ``masks`` keep (per
    layer ``[kv_heads, tokens]``; None: the full cache)."""
    cache, first_logits = copy.deepcopy(scored[0]), scored[1]
    length = cache.get_seq_length()
    with torch.inference_mode():
        for layer, keep in zip(cache.layers, masks or (), strict=False):
            keep_only(layer, keep)
        positions = torch.arange(length, length + continuation.shape[1])
        logits = model(continuation, past_key_values=cache, position_ids=positions[None]).logits
    logits = torch.cat([first_logits, logits[:, :-1]], dim=1).float()
    return math.exp(functional.cross_entropy(logits[0], continuation[0]).item())


def continuation_perplexity(
    model, context, continuation, ratio: float | None, how: str, floor: float, scoring: str = "attention"
) -> float:
    """The continuation's perplexity after the context, its cache cut down by ``how`` (None: the full cache)."""
    scored = scored_prompt(model, context, scoring)
    masks = None
    if ratio is not None:
        masks = allocate([layer.priority(layer.longest)[0] for layer in scored[0].layers], ratio, how, floor)
    return masked_perplexity(model, scored, continuation, masks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-tokens", type=int, default=3072)
    parser.add_argument("--continuation-tokens", type=int, default=512)
    parser.add_argument("--ratios", default="0.5,0.75,0.9")
    add_tuning_texts_argument(parser)
    parser.add_argument("--floor", type=float, default=0.2, help="each head keeps at least this share of its own")
    parser.add_argument("--scoring", choices=("attention", "reconstruction"), default="attention")
    parser.add_argument(
        "--allocations", default=";".join(("CompressedCache, evicting", *ALLOCATIONS)),
        help="the rows to measure, separated by ';' (default: all, the evicting cache first)",
    )  # fmt: skip
    args = parser.parse_args()
    model, tokenizer = load_model()
    tasks = text_tasks(tokenizer, args.texts, args.context_tokens, args.continuation_tokens)
    ratios = [float(value) for value in args.ratios.split(",")]
    full = {}
    for name, task in tasks.items():
        context, continuation = torch.tensor([task["context"]]), torch.tensor([task["continuation"]])
        full[name] = continuation_perplexity(model, context, continuation, None, "", args.floor)
    print(f"tuning texts ({', '.join(tasks)}): {args.context_tokens}-token contexts, "
          f"{args.continuation_tokens}-token continuations; mean (worst) perplexity increase over the full cache; "
          f"head floor {args.floor:.0%}; {args.scoring} scores")  # fmt: skip
    print(f"  {'allocation':28s}" + "".join(f"{f'{ratio:.0%} evicted':>22s}" for ratio in ratios))
    for how in args.allocations.split(";"):  # "CompressedCache, evicting": the cache itself, uniform's twin
        cells = []
        for ratio in ratios:
            increases = []
            for name, task in tasks.items():
                context, continuation = torch.tensor([task["context"]]), torch.tensor([task["continuation"]])
                if how in ALLOCATIONS:
                    value = continuation_perplexity(model, context, continuation, ratio, how, args.floor, args.scoring)
                else:
                    allocation = "global" if args.scoring == "reconstruction" else "uniform"  # as the masks rank
                    replay = {"replay": "forward"} if args.scoring == "reconstruction" else {}  # as the masks score
                    refit = {"matched_layers": 0} if args.scoring == "reconstruction" else {}  # as the masks keep
                    cache = CompressedCache(model, compression_ratio=ratio, scoring=args.scoring, allocation=allocation,
                                            **replay, **refit)  # fmt: skip
                    value = evicting_perplexity(model, cache, context, continuation)
                increases.append(value / full[name] - 1)
            cells.append(f"{statistics.fmean(increases):+8.2%} ({max(increases):+7.2%})")
        print(f"  {how:28s}" + "".join(f"{cell:>22s}" for cell in cells), flush=True)


if __name__ == "__main__":
    main()
