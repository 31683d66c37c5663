"""Where a compiled decoding step's time goes: StaticCache against CompressedCache evicting one token per step,
both through ``torch.compile(model.forward, fullgraph=True)``, greedy steps by hand under ``torch.profiler``.

    python benchmarks/kv_compiled_profile.py --device cuda --shape llama-1b --length 8192 --mode reduce-overhead
    python benchmarks/kv_compiled_profile.py --length 512 --mode default             # host-bound shape, this CPU

For each cache: wall milliseconds per step, the host's time in dynamo's lookup of the step's graph (its guards)
and in the compiled region, on CUDA the kernels' time per step and kernels run per step, then the host events and
kernels that took most time per step. The CompressedCache holds a quarter of the prompt; StaticCache (on a copy
of the model that no CompressedCache bound) holds the prompt and every step.
"""

from __future__ import annotations

import argparse
import collections
import copy
import time

import torch
from kv_cache import SHAPES, shaped_model  # benchmarks/ is on sys.path
from torch.profiler import ProfilerActivity, profile
from transformers import StaticCache

from decodekit.cache import CompressedCache


def decode_profiled(model, forward, prompt: torch.Tensor, cache, warm_up: int, tokens: int):
    """The prompt's pass eager, ``warm_up`` steps through ``forward`` (compiling), then ``tokens`` steps under the
    profiler; returns the profiler's events and the wall milliseconds per profiled step."""
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
        with profile(activities=activities) as profiler:
            started = time.perf_counter()
            for _ in range(tokens):
                token, position = step(token, position), position + 1
            if cuda:
                torch.cuda.synchronize()
            wall = (time.perf_counter() - started) / tokens
    return profiler.events(), wall * 1e3


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
    by_self = collections.Counter()
    for event in host:
        by_self[event.name] += event.self_cpu_time_total
    print("      host events, self time per step:")
    for event_name, total in by_self.most_common(top):
        print(f"         {per_step(total):7.4f} ms  {event_name[:110]}")
    if kernels:
        by_kernel = collections.Counter()
        for event in kernels:
            by_kernel[event.name] += event.device_time
        print("      kernels, time per step:")
        for kernel, total in by_kernel.most_common(top):
            print(f"         {per_step(total):7.4f} ms  {kernel[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--shape", default="host-bound", choices=sorted(SHAPES))
    parser.add_argument("--length", type=int, default=512, help="prompt tokens")
    parser.add_argument("--mode", default="default", help="torch.compile mode (reduce-overhead: CUDA graphs)")
    parser.add_argument("--warm-up", type=int, default=16, help="compiled steps before the profile")
    parser.add_argument("--tokens", type=int, default=64, help="profiled steps")
    parser.add_argument("--top", type=int, default=12, help="host events and kernels listed")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = shaped_model(args.shape, device)
    plain = copy.deepcopy(model)  # never bound by a CompressedCache
    prompt = torch.randint(0, model.config.vocab_size, (1, args.length), device=device)
    room = args.length + args.warm_up + args.tokens
    budget = args.length // 4
    torch._dynamo.config.recompile_limit = 64
    caches = {
        f"StaticCache(max_cache_len={room})": (plain, lambda: StaticCache(config=plain.config, max_cache_len=room)),
        f"CompressedCache(budget={budget}, eviction_interval=1)": (
            model, lambda: CompressedCache(model, budget=budget, eviction_interval=1)
        ),
    }  # fmt: skip
    print(f"{args.shape}-shaped random model on {device}, {args.length}-token prompt; torch.compile mode "
          f"{args.mode!r}, fullgraph; {args.warm_up} steps, then {args.tokens} profiled")  # fmt: skip
    for name, (runs_on, make) in caches.items():
        forward = torch.compile(runs_on.forward, mode=args.mode, fullgraph=True)
        events, wall = decode_profiled(runs_on, forward, prompt, make(), args.warm_up, args.tokens)
        summarize(name, events, wall, args.tokens, args.top)


if __name__ == "__main__":
    main()
