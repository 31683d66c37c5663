"""Where a compiled decoding step's time goes: StaticCache against CompressedCache evicting one token per step,
both through ``torch.compile(model.forward, fullgraph=True)``, greedy steps by hand under ``torch.profiler``.

    python benchmarks/kv_compiled_profile.py --device cuda --shape llama-1b --length 8192 --mode reduce-overhead
    python benchmarks/kv_compiled_profile.py --length 512 --mode default             # host-bound shape, this CPU
    python benchmarks/kv_compiled_profile.py --length 512 --skip-guards    # the same, guards not evaluated

For each cache: wall milliseconds per step, the host's time in dynamo's lookup of the step's graph (its guards)
and in the compiled region, on CUDA the kernels' time per step and kernels run per step, then the host events and
kernels that took most time per step. The CompressedCache holds a quarter of the prompt; StaticCache (on a copy
of the model that no CompressedCache bound) holds the prompt and every step.
"""

from __future__ import annotations

import argparse
import collections
import copy
from contextlib import nullcontext
from functools import partial

import torch
from kv_cache import SHAPES, own_compiled, shaped_model  # benchmarks/ is on sys.path
from kv_step_profile import decode_profiled
from transformers import StaticCache

from decodekit.cache import CompressedCache


def summarize(name: str, events, wall: float, tokens: int, top: int) -> None:
    """Print one cache's figures per step from the profiler's ``events``."""

    def per_step(microseconds: float) -> float:
        return microseconds / 1e3 / tokens

    host = [event for event in events if event.device_type.name == "CPU"]
    kernels = [event for event in events if event.device_type.name == "CUDA"]
    lookup = sum(event.cpu_time_total for event in host if event.name == "TorchDynamo Cache Lookup")
    region = sum(event.cpu_time_total for event in host if event.name.startswith("Torch-Compiled Region"))
    line = (f"   {name:48s} wall {wall:6.2f} ms   graph lookup {per_step(lookup):5.2f} ms   "
            f"compiled region {per_step(region):5.2f} ms")  # fmt: skip
    if kernels:
        busy = per_step(sum(event.device_time for event in kernels))
        line += f"   kernels {busy:5.2f} ms ({len(kernels) / tokens:.0f} a step)"
    print(line)
    print_top("host events, self time per step", host, lambda event: event.self_cpu_time_total, tokens, top)
    if kernels:
        print_top("kernels, time per step", kernels, lambda event: event.device_time, tokens, top)


def print_top(title: str, events, microseconds, tokens: int, top: int) -> None:
    """The ``top`` names among ``events`` by their summed ``microseconds(event)``, in milliseconds per step."""
    totals = collections.Counter()
    for event in events:
        totals[event.name] += microseconds(event)
    print(f"      {title}:")
    for name, total in totals.most_common(top):
        print(f"         {total / 1e3 / tokens:7.4f} ms  {name[:110]}")


def compiled_step_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of a benchmark of compiled decoding steps (this one): the device, the
    model's shape, the prompt's length and ``torch.compile``'s mode."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--shape", default="host-bound", choices=sorted(SHAPES))
    parser.add_argument("--length", type=int, default=512, help="prompt tokens")
    parser.add_argument("--mode", default="default", help="torch.compile mode (reduce-overhead: CUDA graphs)")
    return parser


def compiled_step_setup(args) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor, int]:
    """For ``compiled_step_parser``'s arguments: the random model of ``args.shape`` that the CompressedCaches bind, a
    copy that none binds (StaticCache's), a random prompt, and the budget (a quarter of the prompt, never below the
    sinks and recent window)."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = shaped_model(args.shape, device)
    plain = copy.deepcopy(model)  # never bound by a CompressedCache
    prompt = torch.randint(0, model.config.vocab_size, (1, args.length), device=device)
    return model, plain, prompt, max(args.length // 4, 36)


def main() -> None:
    parser = compiled_step_parser(__doc__)
    parser.add_argument("--warm-up", type=int, default=16, help="compiled steps before the profile")
    parser.add_argument("--tokens", type=int, default=64, help="profiled steps")
    parser.add_argument("--top", type=int, default=12, help="host events and kernels listed")
    parser.add_argument(
        "--skip-guards",
        action="store_true",
        help="profile with guard evaluation skipped (torch.compiler.set_stance(skip_guard_eval_unsafe=True)): "
        "the step without its graph lookup's guards",
    )
    args = parser.parse_args()
    model, plain, prompt, budget = compiled_step_setup(args)
    room = args.length + args.warm_up + args.tokens
    caches = {
        f"StaticCache(max_cache_len={room})": (plain, lambda: StaticCache(config=plain.config, max_cache_len=room)),
        f"CompressedCache(budget={budget}, eviction_interval=1)": (
            model, lambda: CompressedCache(model, budget=budget, eviction_interval=1)
        ),
    }  # fmt: skip
    print(f"{args.shape}-shaped random model on {prompt.device}, {args.length}-token prompt; torch.compile mode "
          f"{args.mode!r}, fullgraph; {args.warm_up} steps, then {args.tokens} profiled")  # fmt: skip
    stance = partial(torch.compiler.set_stance, skip_guard_eval_unsafe=True) if args.skip_guards else nullcontext
    for index, (name, (runs_on, make)) in enumerate(caches.items()):
        forward = own_compiled(runs_on, f"variant{index}", mode=args.mode, fullgraph=True)
        events, wall = decode_profiled(runs_on, forward, prompt, make(), args.warm_up, args.tokens, stance)
        summarize(name, events, wall, args.tokens, args.top)


if __name__ == "__main__":
    main()
