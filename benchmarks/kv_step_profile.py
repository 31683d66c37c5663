"""Where a decoding step's time goes: greedy steps by hand for DynamicCache and CompressedCache settings, and on
CUDA how much of a step the GPU is busy.

    python benchmarks/kv_step_profile.py --device cuda --shape llama-1b --lengths 32768,8192
    python benchmarks/kv_step_profile.py --shape host-bound --lengths 1024          # the same on this CPU
    python benchmarks/kv_step_profile.py --by-function --lengths 1024 --tokens 8    # the byte-sized step's operators

For each prompt length: tokens/s of greedy steps by hand (``kv_cache.loop_decode``; median of --rounds interleaved
rounds, each cache once per round) against DynamicCache, for the default CompressedCache (a 25% budget), the same
with a budget that never evicts (what its steps cost without eviction) and the byte-sized reconstruction cache
(``memory_fraction=0.25``). Then, on the first length, ``torch.profiler`` over --tokens steps of each of those but
the one that never evicts: operators per step, wall time per step and, on CUDA, the time kernels ran per step. Where the
kernels run for a small share of the wall time, the host bounds the step (the operators launched and the Python
around them), and a cache that reads fewer entries cannot decode faster by reading less: only by launching less.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from kv_cache import SHAPES, byte_sized_cache, loop_decode, shaped_model  # benchmarks/ is on sys.path
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from decodekit.cache import CompressedCache

OPERATORS = ("aten::", "decodekit::")  # what a step launches: PyTorch's operators and decodekit's CPU attention
CACHES = ("DynamicCache", "CompressedCache", "CompressedCache never evicting", "memory_fraction=0.25")


def make_cache(name: str, model, length: int, tokens: int):
    """A new cache of the setting ``name`` for a ``length``-token prompt and ``tokens`` steps."""
    if name == "DynamicCache":
        return DynamicCache()
    if name == "CompressedCache":
        return CompressedCache(model, budget=max(length // 4, 36))  # never below the sinks and recent window
    if name == "CompressedCache never evicting":
        return CompressedCache(model, budget=length + tokens + 64)
    return byte_sized_cache(model)


def decode_profiled(
    model, forward, prompt: torch.Tensor, cache, warm_up: int, tokens: int, profiled=contextlib.nullcontext,
    with_stack: bool = False,
):
    """The prompt's pass eager, ``warm_up`` greedy steps through ``forward`` (``model.forward``, or a compiled
    forward, which compiles then), then ``tokens`` steps under ``torch.profiler`` and in the context ``profiled()``;
    returns the profiler's events and the wall milliseconds per profiled step."""
    cuda = prompt.is_cuda
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch.no_grad():
        token = model(prompt, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(dim=-1)
        position = prompt.shape[1]

        def step(token: torch.Tensor, position: int) -> torch.Tensor:
            ids = torch.tensor([[position]], device=prompt.device)
            logits = forward(token, past_key_values=cache, position_ids=ids, cache_position=ids[0]).logits
            return logits[:, -1:].argmax(dim=-1)

        for _ in range(warm_up):
            token, position = step(token, position), position + 1
        if cuda:
            torch.cuda.synchronize()
        with profiled(), profile(activities=activities, with_stack=with_stack) as profiler:
            started = time.perf_counter()
            for _ in range(tokens):
                token, position = step(token, position), position + 1
            if cuda:
                torch.cuda.synchronize()
            wall = (time.perf_counter() - started) / tokens
    return profiler.events(), wall * 1e3


def profiled_step(model, prompt: torch.Tensor, cache, tokens: int) -> tuple[float, float, float]:
    """Top-level operators, wall milliseconds and kernel milliseconds (NaN off CUDA) per step, over ``tokens``
    greedy steps after the prompt's pass and 8 steps of warm-up."""
    events, wall = decode_profiled(model, model.forward, prompt, cache, 8, tokens)
    operators = sum(1 for event in events if event.name.startswith(OPERATORS) and event.cpu_parent is None)
    kernels = float("nan")
    if prompt.is_cuda:
        kernels = sum(event.device_time for event in events if event.device_type.name == "CUDA") / 1e3 / tokens
    return operators / tokens, wall, kernels


def operators_by_function(model, prompt: torch.Tensor, cache, tokens: int) -> dict[str, float]:
    """Per step, the top-level operators each decodekit function launched (the innermost decodekit function on the
    Python stack when the operator ran; "the model" for the rest), most first."""
    events, _ = decode_profiled(model, model.forward, prompt, cache, 8, tokens, with_stack=True)
    counts: dict[str, int] = {}
    for event in events:
        parent = event.cpu_parent
        if not event.name.startswith(OPERATORS) or (parent is not None and parent.name.startswith(OPERATORS)):
            continue
        owner = "the model"
        while parent is not None:
            if "decodekit/" in parent.name:
                owner = parent.name.split("decodekit/")[-1]
                break
            parent = parent.cpu_parent
        counts[owner] = counts.get(owner, 0) + 1
    return {owner: count / tokens for owner, count in sorted(counts.items(), key=lambda item: -item[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--shape", default="host-bound", choices=sorted(SHAPES))
    parser.add_argument("--lengths", default="1024", help="prompt lengths, comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="greedy steps per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--caches", default=",".join(CACHES), help=f"comma-separated, from {', '.join(CACHES)}")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="profile DynamicCache's and the default's steps at the first length")  # fmt: skip
    parser.add_argument("--by-function", action="store_true",
                        help="only the byte-sized cache's operators per step at the first length, by the decodekit "
                             "function that launched them")  # fmt: skip
    args = parser.parse_args()
    chosen = [name.strip() for name in args.caches.split(",")]
    unknown = sorted(set(chosen) - set(CACHES))
    if unknown:
        raise SystemExit(f"--caches: unknown {unknown}; choose from {list(CACHES)}")
    if "DynamicCache" not in chosen:
        chosen.insert(0, "DynamicCache")
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = shaped_model(args.shape, device)
    vocab = model.config.vocab_size
    lengths = [int(value) for value in args.lengths.split(",")]
    if args.by_function:
        prompt = torch.randint(0, vocab, (1, lengths[0]), device=device)
        counts = operators_by_function(model, prompt, make_cache(CACHES[-1], model, lengths[0], args.tokens),
                                       args.tokens)  # fmt: skip
        print(f"{args.shape}-shaped random model on {device}, {lengths[0]}-token prompt: {CACHES[-1]}, top-level "
              f"operators per step ({sum(counts.values()):.0f} in all) by the function that launched them")
        for owner, count in counts.items():
            print(f"   {count:7.1f}  {owner}")
        return
    for name in chosen:  # warm-up: kernels, library start-up
        loop_decode(model, model.forward, torch.randint(0, vocab, (1, 256), device=device),
                    make_cache(name, model, 256, 4), 4)  # fmt: skip
    print(f"{args.shape}-shaped random model on {device}; greedy steps by hand, {args.tokens} per measurement, "
          f"median of {args.rounds} interleaved rounds; 25% budget")  # fmt: skip
    for length in lengths:
        prompt = torch.randint(0, vocab, (1, length), device=device)
        rates = {name: [] for name in chosen}
        for _ in range(args.rounds):
            for name in chosen:
                cache = make_cache(name, model, length, args.tokens)
                rates[name].append(loop_decode(model, model.forward, prompt, cache, args.tokens))
        full = statistics.median(rates["DynamicCache"])
        for name in chosen:
            rate = statistics.median(rates[name])
            print(f"   {length:7d} {name:34s} {rate:8.1f} tok/s  {rate / full:5.2f}x DynamicCache  "
                  f"rounds {[round(value, 1) for value in rates[name]]}")  # fmt: skip
    if not args.profile:
        return
    length = lengths[0]
    prompt = torch.randint(0, vocab, (1, length), device=device)
    print(f"   per step at {length} tokens (torch.profiler): top-level operators, wall ms, kernel ms (CUDA)")
    counted = {}
    for name in [name for name in CACHES if name in chosen and name != "CompressedCache never evicting"]:
        operators, wall, kernels = profiled_step(model, prompt, make_cache(name, model, length, args.tokens),
                                                 args.tokens)  # fmt: skip
        counted[name] = operators
        busy = f", the GPU busy {kernels / wall:.0%} of it" if kernels == kernels else ""
        print(f"   {length:7d} {name:34s} {operators:7.0f} operators  {wall:7.2f} ms  {kernels:6.2f} ms{busy}")
    for name, operators in counted.items():
        if name != "DynamicCache":
            ratio = operators / counted["DynamicCache"]
            target = f" ({'meets' if ratio <= 1.5 else 'MISSES'} the target of 1.5x)" if name == CACHES[-1] else ""
            print(f"   operators per step, {name} / DynamicCache: {ratio:.2f}x{target}")


if __name__ == "__main__":
    main()
