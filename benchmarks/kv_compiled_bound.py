"""The fastest a compiled decoding step of CompressedCache could be: StaticCache, ours evicting one token per step,
and ours with the step's scoring and ranking taken out, all through ``torch.compile(model.forward, fullgraph=True)``.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/kv_compiled_bound.py                 # host-bound shape, CPU
    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/kv_compiled_bound.py --skip-guards   # guards not evaluated
    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/kv_compiled_bound.py --cpp-wrapper   # kernels called from C++
    python benchmarks/kv_compiled_bound.py --device cuda --shape llama-1b --length 8192 --mode reduce-overhead

The unscored row decodes with the same storage as ``eviction_interval=1`` (``budget + 1`` slots, a mask of the live
entries), but its steps neither score nor rank: each writes its token into the slot the last step freed and frees
that slot again (one write). What it still pays at every step (the observed queries, the token's entries written
into a compressed layout, the mask, the scores' decay, the guards on the cache's state) is about what any design
pays that scores and ranks less often (evicting several tokens in place every few steps, the waiting steps scored
together), so its speed bounds such designs from above. Rows: the median of interleaved rounds of greedy steps by
hand, after a warm-up that compiles; the CompressedCaches hold a quarter of the prompt, StaticCache (on a copy of
the model that no CompressedCache bound) the prompt and every step.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from kv_cache import loop_decode, own_compiled  # benchmarks/ is on sys.path
from kv_compiled_profile import compiled_step_parser, compiled_step_setup
from transformers import StaticCache

from decodekit.cache import CompressedCache
from decodekit.cache.layer import CompressedLayer


@contextmanager
def unscored_steps() -> Iterator[None]:
    """While open, the decoding steps of a layer marked ``unscored`` that store their token in a free slot free
    that slot again, without scoring or ranking (the prompt's pass, which fills no free slot, runs as always)."""
    finish_pass, compress = CompressedLayer.finish_pass, CompressedLayer._compress

    def finish_unscored(layer, keys, values):
        # A step into a free slot (the prompt's pass appends): it took the slot the last step freed.
        layer.unscored_step = getattr(layer, "unscored", False) and layer._stored_pass.free is not None
        if not layer.unscored_step:
            return finish_pass(layer, keys, values)
        layer._stored_pass = None
        return None

    def compress_unscored(layer, new):
        if not getattr(layer, "unscored_step", False):
            return compress(layer, new)
        # Free the slot the step took again, writing no tensor the graph would return.
        layer.live.scatter_(2, layer._freed, False)
        layer._freed_taken = 0
        layer._add_live(-1)
        return None

    CompressedLayer.finish_pass, CompressedLayer._compress = finish_unscored, compress_unscored
    try:
        yield
    finally:
        CompressedLayer.finish_pass, CompressedLayer._compress = finish_pass, compress


def unscored_cache(model, budget: int) -> CompressedCache:
    """A cache evicting one token per step whose layers are marked ``unscored`` (see ``unscored_steps``)."""
    cache = CompressedCache(model, budget=budget, eviction_interval=1)
    for layer in cache.layers:
        layer.unscored = True
    return cache


def main() -> None:
    parser = compiled_step_parser(__doc__)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (eager: the graphs uncompiled)")
    parser.add_argument("--tokens", type=int, default=32, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warm-up", type=int, default=16, help="compiled steps before any timing")
    parser.add_argument(
        "--cpp-wrapper", action="store_true",
        help="inductor's C++ wrapper (options={'cpp_wrapper': True}): the compiled graph's kernels called from C++, "
        "not from a generated Python function",
    )  # fmt: skip
    parser.add_argument(
        "--skip-guards", action="store_true",
        help="time with guard evaluation skipped (torch.compiler.set_stance(skip_guard_eval_unsafe=True))",
    )  # fmt: skip
    args = parser.parse_args()
    if args.cpp_wrapper and args.backend != "inductor":
        parser.error(f"--cpp-wrapper: inductor's option; not with --backend {args.backend}")
    model, plain, prompt, budget = compiled_step_setup(args)
    room = args.length + max(args.tokens, args.warm_up)
    caches = {
        "StaticCache": (plain, lambda: StaticCache(config=plain.config, max_cache_len=room)),
        f"CompressedCache(budget={budget}, eviction_interval=1)": (
            model, lambda: CompressedCache(model, budget=budget, eviction_interval=1)
        ),
        "  the same, steps unscored (the bound)": (model, lambda: unscored_cache(model, budget)),
    }  # fmt: skip
    compile_model = partial(own_compiled, fullgraph=True, backend=args.backend)
    if args.cpp_wrapper:  # (torch.compile takes a mode or options, not both: the mode's options join the wrapper's)
        compile_model = partial(
            compile_model, options={"cpp_wrapper": True, **torch._inductor.list_mode_options(args.mode)}
        )
    elif args.backend == "inductor":
        compile_model = partial(compile_model, mode=args.mode)
    forwards = {
        name: compile_model(runs_on, f"variant{index}") for index, (name, (runs_on, _)) in enumerate(caches.items())
    }
    stance = partial(torch.compiler.set_stance, skip_guard_eval_unsafe=True) if args.skip_guards else nullcontext
    rates = {name: [] for name in caches}
    with unscored_steps():
        for name, (runs_on, make) in caches.items():  # compile before any timing
            loop_decode(runs_on, forwards[name], prompt, make(), args.warm_up)
        for _ in range(args.rounds):
            for name, (runs_on, make) in caches.items():
                with stance():
                    rates[name].append(loop_decode(runs_on, forwards[name], prompt, make(), args.tokens))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    static = medians["StaticCache"]
    guards = "skipped" if args.skip_guards else "evaluated"
    wrapper = ", C++ wrapper" if args.cpp_wrapper else ""
    print(f"{args.shape}-shaped random model on {prompt.device}, {args.length}-token prompt; torch.compile backend "
          f"{args.backend!r}, mode {args.mode!r}{wrapper}, fullgraph, guards {guards}; {args.tokens} greedy steps "
          f"a round, median of {args.rounds} interleaved rounds")  # fmt: skip
    for name, rate in medians.items():
        print(f"   {name:<52} {rate:8.1f} tok/s   {1e3 / rate:6.2f} ms a step   {rate / static:.2f}x StaticCache")


if __name__ == "__main__":
    main()
