"""How to code keys (or values) in 4 bits: the perplexity a continuation loses when only the context's keys are
coded, with each scheme, and nothing is evicted.

The context is prefilled into a full cache; its keys (or values) are replaced by their coded-and-decoded
copies; the continuation is then scored over them in one pass. The schemes:

- ``rotated`` (what ``CompressedCache`` stores): each entry rotated by a Hadamard matrix, then per-token
  groups of ``--group`` channels (``Quantizer(rotated=True)``); also in 5 and 8 bits (every other scheme codes 4);
- ``rotated, first token exact`` / ``first 4 exact``: the same, with the attention sink's keys left exact;
- ``rotated, groups of 16``: twice the scales and offsets;
- ``rotated in blocks of N``: the same, rotated by a block-diagonal Hadamard matrix of N-channel blocks instead
  of the whole entry (a turn that costs N / head_dim of the whole one's products when decoding);
- ``plain``: per-token groups of channels as they are (``Quantizer()``);
- ``channel magnitude``: each channel first divided by its largest size over the context (the previous
  key coding), then per-token groups;
- ``per channel, N-token groups`` (KIVI's key coding): a scale and offset per channel over each N
  consecutive tokens, which a cache that evicts single tokens cannot keep (shown for reference).

    python benchmarks/kv_key_coding.py [--part keys|values] [--texts tuning|tuning2|protocol] [--only NAMES]
        [--group 32] [--schemes "rotated, groups of 32;rotated, groups of 32, 5 bits"]
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

import torch
from kv_protocol import add_text_arguments, chosen_texts, text_tasks
from torch.nn import functional
from transformers import DynamicCache

from decodekit import load_model
from decodekit.cache.quantize import Quantizer, hadamard


def _coded(quantizer: Quantizer) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda states: quantizer.decode(quantizer.encode(states), torch.float32)


def _rotated_in_blocks(group: int, block: int) -> Callable[[torch.Tensor], torch.Tensor]:
    plain = Quantizer(4, group)

    def hadamard_rotate(states: torch.Tensor) -> torch.Tensor:
        return (states.unflatten(-1, (-1, block)) @ hadamard(block, states.device)).flatten(-2)

    return lambda states: hadamard_rotate(plain.decode(plain.encode(hadamard_rotate(states.float())), torch.float32))


def _channel_magnitude(group: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def code(states: torch.Tensor) -> torch.Tensor:
        magnitude = states.abs().amax(dim=2, keepdim=True).clamp(min=1e-6)
        return _coded(Quantizer(4, group))(states / magnitude) * magnitude

    return code


def _first_exact(code: Callable[[torch.Tensor], torch.Tensor], tokens: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``code``, with the context's first ``tokens`` tokens (the attention sink) left exact."""

    def coded(states: torch.Tensor) -> torch.Tensor:
        out = code(states)
        out[:, :, :tokens] = states[:, :, :tokens]
        return out

    return coded


def _per_channel(tokens: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def code(states: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(states)
        for start in range(0, states.shape[2], tokens):
            block = states[:, :, start : start + tokens]
            low, high = block.amin(dim=2, keepdim=True), block.amax(dim=2, keepdim=True)
            scale = ((high - low) / 15).clamp(min=1e-8)
            out[:, :, start : start + tokens] = ((block - low) / scale).round().clamp(0, 15) * scale + low
        return out

    return code


def schemes(group: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor] | None]:
    return {
        "exact": None,
        f"rotated, groups of {group}": _coded(Quantizer(4, group, rotated=True)),
        f"rotated, groups of {group}, 5 bits": _coded(Quantizer(5, group, rotated=True)),
        f"rotated, groups of {group}, 8 bits": _coded(Quantizer(8, group, rotated=True)),
        f"rotated, groups of {group}, first token exact": _first_exact(_coded(Quantizer(4, group, rotated=True)), 1),
        f"rotated, groups of {group}, first 4 exact": _first_exact(_coded(Quantizer(4, group, rotated=True)), 4),
        "rotated, groups of 16": _coded(Quantizer(4, 16, rotated=True)),
        f"rotated in blocks of 32, groups of {group}": _rotated_in_blocks(group, 32),
        f"rotated in blocks of 16, groups of {group}": _rotated_in_blocks(group, 16),
        f"plain, groups of {group}": _coded(Quantizer(4, group)),
        f"channel magnitude, groups of {group}": _channel_magnitude(group),
        "per channel, 32-token groups": _per_channel(32),
        "per channel, 128-token groups": _per_channel(128),
    }


def perplexity(model, task: dict, part: str, code: Callable | None) -> float:
    context = torch.tensor([task["context"]])
    continuation = torch.tensor([task["continuation"]])
    cache = DynamicCache()
    with torch.inference_mode():
        prefill = model(context, past_key_values=cache)
        if code is not None:
            for layer in cache.layers:
                states = getattr(layer, part)
                setattr(layer, part, code(states.float()).to(states.dtype))
        positions = torch.arange(context.shape[1], context.shape[1] + continuation.shape[1])[None]
        logits = model(continuation, past_key_values=cache, position_ids=positions).logits
    logits = torch.cat([prefill.logits[:, -1:], logits[:, :-1]], dim=1).float()
    return math.exp(functional.cross_entropy(logits[0], continuation[0]).item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("keys", "values"), default="keys")
    add_text_arguments(parser)
    parser.add_argument("--context-tokens", type=int, default=3072)
    parser.add_argument("--continuation-tokens", type=int, default=512)
    parser.add_argument("--group", type=int, default=32, help="channels per group of the per-token schemes")
    parser.add_argument("--schemes", help="names of the schemes to run, separated by semicolons (default: all)")
    args = parser.parse_args()
    texts = chosen_texts(parser, args)
    model, tokenizer = load_model()
    tasks = text_tasks(tokenizer, texts, args.context_tokens, args.continuation_tokens)
    coding = schemes(args.group)
    if args.schemes:
        chosen = args.schemes.split(";")
        unknown = set(chosen) - set(coding)
        if unknown:
            parser.error(f"--schemes: unknown {sorted(unknown)}; known: {sorted(coding)}")
        coding = {name: code for name, code in coding.items() if name == "exact" or name in chosen}
    rises: dict[str, list[float]] = {name: [] for name in coding if name != "exact"}
    for task in tasks.values():
        exact = perplexity(model, task, args.part, None)
        for name, code in coding.items():
            if code is not None:
                rises[name].append(perplexity(model, task, args.part, code) / exact - 1)
    print(
        f"{args.texts} texts, {args.context_tokens}-token contexts, {args.continuation_tokens}-token continuations; "
        f"the context's {args.part} coded (in 4 bits unless named), nothing evicted; perplexity rise over the full "
        "cache (%)"
    )
    print(f"{'scheme':44s}" + "".join(f"{name[:14]:>15s}" for name in tasks) + "    mean   worst")
    for name, values in rises.items():
        cells = "".join(f"{value:+15.2%}" for value in values)
        print(f"{name:44s}{cells} {statistics.fmean(values):+7.2%} {max(values):+7.2%}")


if __name__ == "__main__":
    main()
