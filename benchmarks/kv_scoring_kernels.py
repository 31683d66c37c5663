"""The Triton scoring kernels against the attention they shadow, per layer, on a GPU.

    python benchmarks/kv_scoring_kernels.py --lengths 8192,32768

For one layer of Llama-3.2-1B's shape (32 query heads, 8 KV heads, head_dim 64, bf16, batch 1) and
each prompt length, prints the time of PyTorch's causal scaled_dot_product_attention (what the model
runs anyway) and of CompressedCache's exact scores (``attention_received``: a per-query log-sum-exp
pass and a column-sum pass) under several tilings, each as a multiple of the attention's time.
The scores of the first tiling are checked against a float64 reference on a slice of queries.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from torch.nn import functional

from decodekit.cache._triton_scoring import COLUMN_TILING, ROW_TILING, Tiling, attention_received

TILINGS = {  # (row tiling, column tiling); the default is 64x64 tiles, 4 warps, 3 stages
    "default": (ROW_TILING, COLUMN_TILING),
    "64x64, 2 stages": (Tiling(64, 64, 4, 2), Tiling(64, 64, 4, 2)),
    "128 rows / 128 columns, 8 warps": (Tiling(128, 64, 8, 3), Tiling(64, 128, 8, 3)),
    "128 rows / 128 columns, 4 warps": (Tiling(128, 64, 4, 3), Tiling(64, 128, 4, 3)),
    "128x128, 8 warps": (Tiling(128, 128, 8, 2), Tiling(128, 128, 8, 2)),
}


def milliseconds(run, repeats: int) -> float:
    """Median time of ``run()`` in ms, by CUDA events, after two warm-up calls."""
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def check(queries: torch.Tensor, keys: torch.Tensor, received: torch.Tensor, scaling: float) -> float:
    """Largest absolute error of ``received`` against float64 column sums (all queries, one KV head)."""
    group = queries.shape[1] // keys.shape[1]
    logits = queries[:, :group].double() @ keys[:, :1].double().transpose(-1, -2) * scaling
    length = keys.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=keys.device).tril()
    expected = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1).sum(dim=(1, 2))
    return (received[0, 0].double() - expected[0]).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    torch.manual_seed(0)
    heads, kv_heads, head_dim, scaling = 32, 8, 64, 64**-0.5
    device = torch.cuda.get_device_name()
    print(f"one layer, {heads} query heads, {kv_heads} KV heads, head_dim {head_dim}, bf16, batch 1, {device}")
    for length in (int(value) for value in args.lengths.split(",")):
        queries = torch.randn(1, heads, length, head_dim, device="cuda", dtype=torch.bfloat16)
        keys = torch.randn(1, kv_heads, length, head_dim, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)

        attention = partial(
            functional.scaled_dot_product_attention, queries, keys, values, is_causal=True, enable_gqa=True
        )
        base = milliseconds(attention, args.repeats)
        print(f"  {length:6d} tokens: causal SDPA {base:8.3f} ms")
        if length <= 8192:
            error = check(queries, keys, attention_received(queries, keys, scaling), scaling)
            print(f"  {length:6d} tokens: default tiling, largest error against float64: {error:.2e}")
        for name, (rows, columns) in TILINGS.items():
            scores = partial(attention_received, queries, keys, scaling, row_tiling=rows, column_tiling=columns)
            try:
                spent = milliseconds(scores, args.repeats)
            except Exception as error:  # a tiling the GPU cannot hold (shared memory) is reported, not fatal
                print(f"  {length:6d} tokens: scores, {name:34s} failed: {type(error).__name__}")
                continue
            print(f"  {length:6d} tokens: scores, {name:34s} {spent:8.3f} ms  {spent / base:5.2f}x the attention")


if __name__ == "__main__":
    main()
