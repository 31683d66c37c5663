"""Quality per byte: at the same memory, is it better to keep fewer tokens in 16 bits or more in 8 or 4?

For each memory size (a fraction of the bytes a full 16-bit cache holds for the context), each
storage width is given that size through ``CompressedCache(memory_fraction=...)``, which chooses how
many tokens fit (keys, values, scales and bookkeeping counted). The context is prefilled through
the cache and the continuation scored over what it kept, as the protocol does. Printed per row: the
bytes the cache held after each pass (its ``memory_bytes()``, as a fraction of the 16-bit cache generate
would hold: sliding-window layers at their window), the tokens it kept, and the perplexity rise over the
full cache, per text and mean.

    python benchmarks/kv_bytes.py [--texts tuning|tuning2|protocol] [--only NAMES] [--fractions 0.5,0.25,0.1]
        [--bits 16,8,4]
    python benchmarks/kv_bytes.py --scoring reconstruction --allocation heads --ratios 0.5,0.75,0.9 --bits model
    python benchmarks/kv_bytes.py --scoring reconstruction --replay "KVzip's replay"  # a kv_replay.py row
    python benchmarks/kv_bytes.py --scoring reconstruction --ratios 0.5,0.75,0.9 --bits model --presses KVzip
    python benchmarks/kv_bytes.py --model gemma-3-270m-q4_k_m.gguf --texts protocol --fractions 0.25,0.1 --bits model

``--presses`` adds kvpress presses (in kvpress's own virtualenv, as ``kv_cache.py`` runs them) at the same share of
the tokens removed (a memory size ``f`` as the share ``1 - f``: their bytes counted as if freed), on the same texts,
each rise taken over the full cache measured in that virtualenv (a press at ratio 0).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
from kv_protocol import add_text_arguments, chosen_texts, text_tasks
from kv_replay import chosen_rows
from torch.nn import functional

from decodekit import load_model
from decodekit.cache import CompressedCache
from decodekit.cache.size import full_cache_bytes


def _widths(text: str) -> dict[str, int | None]:
    """``16``, ``8``, ``5``, ``4``, ``8/4`` or ``5/4`` (keys in 8 or 5 bits, values in 4) or ``model`` (the model's
    dtype, or the widths a cache sized in bytes picks by itself)."""
    if text == "model":
        return {"kv_bits": None}
    keys, _, values = text.partition("/")
    return {"kv_bits": int(values or keys), "key_bits": int(keys) if values else None}


def measure(
    model,
    task: dict,
    fraction: float | None,
    widths: dict,
    scoring: str,
    *,
    ratio: float | None = None,
    chunk: int | None = None,
    **options,
) -> dict:
    """Perplexity of the task's continuation over what the cache kept of the context, and the cache's bytes
    (as a fraction of a full 16-bit cache's) and kept tokens after the context's pass. The cache holds
    ``fraction`` of a full 16-bit cache's bytes, or evicts ``ratio`` of the tokens (None: neither). The context
    is read in one pass, or in passes of ``chunk`` tokens (as generate's ``prefill_chunk_size`` reads it)."""
    context = torch.tensor([task["context"]])
    continuation = torch.tensor([task["continuation"]])
    if fraction is None:
        cache = CompressedCache(model, compression_ratio=ratio or 0.0, scoring=scoring, **widths, **options)
    else:
        cache = CompressedCache(model, memory_fraction=fraction, scoring=scoring, **widths, **options)
    with torch.inference_mode():
        for start in range(0, context.shape[1], chunk or context.shape[1]):
            piece = context[:, start : start + (chunk or context.shape[1])]
            places = torch.arange(start, start + piece.shape[1])[None]
            prefill = model(piece, past_key_values=cache, position_ids=places)
        cache.end_context()  # (the continuation is not part of the context)
        held = cache.memory_bytes() / full_cache_bytes(model, context.shape[1], element_size=2, windows=True)
        kept = cache.kept_tokens
        positions = torch.arange(context.shape[1], context.shape[1] + continuation.shape[1])[None]
        logits = model(continuation, past_key_values=cache, position_ids=positions).logits
    logits = torch.cat([prefill.logits[:, -1:], logits[:, :-1]], dim=1).float()
    perplexity = math.exp(functional.cross_entropy(logits[0], continuation[0]).item())
    return {"perplexity": perplexity, "bytes": held, "kept": kept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_text_arguments(parser)
    parser.add_argument("--model", help="a local model directory or .gguf file (default: the embedded model)")
    parser.add_argument("--context-tokens", type=int, default=3072)
    parser.add_argument("--continuation-tokens", type=int, default=512)
    parser.add_argument("--fractions", default="0.5,0.25,0.1", help="memory sizes, fractions of a full 16-bit cache")
    parser.add_argument(
        "--bits",
        default="16,8,8/4,4",
        help="storage widths to compare: 16, 8, 5, 4, 8/4 or 5/4 (keys/values), model (the cache's own choice)",
    )
    parser.add_argument("--scoring", default="attention")
    parser.add_argument("--allocation", help="uniform, global or heads (default: the scoring's)")
    parser.add_argument("--ratios", help="instead of byte sizes: evict these shares of the tokens (equal tokens)")
    parser.add_argument("--replay", help="how reconstruction scoring replays the prompt: a row of kv_replay.py")
    parser.add_argument("--residual-length", type=int, help="last tokens also held exact (default: recent_tokens)")
    parser.add_argument("--group-size", type=int, help="channels per scale group at 8 and 4 bits (default: 32)")
    parser.add_argument("--no-smooth-keys", action="store_true", help="code keys whole, without their mean taken out")
    parser.add_argument("--eviction-interval", type=int, help="tokens evicted at once (default: the cache's)")
    parser.add_argument("--matched-layers", type=int, help="first layers refit after eviction (default: the cache's)")
    parser.add_argument("--prefill-chunk", type=int, help="read each context in passes of this many tokens")
    parser.add_argument("--presses", help="also these kvpress presses, comma-separated (KVzip, SnapKV, ...)")
    parser.add_argument("--kvpress-python", help="python of a virtualenv that has kvpress installed")
    args = parser.parse_args()
    texts = chosen_texts(parser, args)
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    tasks = text_tasks(tokenizer, texts, args.context_tokens, args.continuation_tokens)
    full = {name: measure(model, task, None, {}, args.scoring)["perplexity"] for name, task in tasks.items()}
    widths = args.bits.split(",")
    names = list(tasks)
    print(f"{args.model or 'the default model'}: {args.texts} texts, {args.context_tokens}-token contexts,"
          f" {args.continuation_tokens}-token continuations,"
          f" scoring={args.scoring}{f', replay: {args.replay}' if args.replay else ''}"
          f"{f', residual_length={args.residual_length}' if args.residual_length is not None else ''}"
          f"{f', kv_group_size={args.group_size}' if args.group_size else ''}"
          f"{', smooth_keys=False' if args.no_smooth_keys else ''}"
          f"{f', eviction_interval={args.eviction_interval}' if args.eviction_interval else ''}"
          f"{f', matched_layers={args.matched_layers}' if args.matched_layers is not None else ''}"
          f"{f', the context in chunks of {args.prefill_chunk}' if args.prefill_chunk else ''};"
          " perplexity rise over the full cache (%)")  # fmt: skip
    header = f"{'memory':>7} {'bits':>5} {'held':>6} {'kept':>5} " + " ".join(f"{name[:14]:>14}" for name in names)
    print(header + f" {'mean':>7} {'worst':>7}")
    options = {"allocation": args.allocation} if args.allocation else {}
    if args.residual_length is not None:
        options["residual_length"] = args.residual_length
    if args.group_size:
        options["kv_group_size"] = args.group_size
    if args.no_smooth_keys:
        options["smooth_keys"] = False
    if args.eviction_interval:
        options["eviction_interval"] = args.eviction_interval
    if args.matched_layers is not None:
        options["matched_layers"] = args.matched_layers
    if args.replay:
        try:
            options.update(chosen_rows(tokenizer, [args.replay])[args.replay])
        except ValueError as error:
            parser.error(f"--replay: {error}")
    sizes = [(None, float(text)) for text in args.ratios.split(",")] if args.ratios else [
        (float(text), None) for text in args.fractions.split(",")]  # fmt: skip
    for fraction, ratio in sizes:
        for bits in widths:
            rows = {name: measure(model, task, fraction, _widths(bits), args.scoring, ratio=ratio,
                                  chunk=args.prefill_chunk, **options)
                    for name, task in tasks.items()}  # fmt: skip
            rises = [100 * (rows[name]["perplexity"] / full[name] - 1) for name in names]
            held = max(row["bytes"] for row in rows.values())
            kept = min(row["kept"] for row in rows.values())
            cells = " ".join(f"{rise:>+14.2f}" for rise in rises)
            size = f"{fraction:>7.0%}" if fraction is not None else f"{f'-{ratio:.0%}':>7s}"
            print(f"{size} {bits:>5} {held:>6.1%} {kept:>5} {cells} "
                  f"{statistics.fmean(rises):>+7.2f} {max(rises):>+7.2f}", flush=True)  # fmt: skip
    if args.presses:
        shares = [ratio if ratio is not None else 1 - fraction for fraction, ratio in sizes]
        print_presses(args, model, tasks, shares)


def print_presses(args, model, tasks: dict, shares: list[float]) -> None:
    """The rows of ``--presses`` at each share of the tokens removed, their rises over the full cache measured in
    kvpress's virtualenv (the first press at ratio 0, which removes nothing)."""
    from kv_cache import kvpress_python, run_presses  # (kv_cache imports this module)

    python = kvpress_python(argparse.Namespace(skip_kvpress=False, kvpress_python=args.kvpress_python))
    presses = [name.strip() for name in args.presses.split(",")]
    press_tasks = {"ratios": [0.0, *shares], "texts": tasks, "pass_keys": []}
    try:
        rows = run_presses(python, model, press_tasks, presses)
    except RuntimeError as error:
        raise SystemExit(f"--presses: {error}") from None
    failed = [row for row in rows if row["task"] == "error"]
    if failed:
        raise SystemExit(f"--presses: {failed[0]['method']} failed: {failed[0]['error']}")
    first = f"kvpress {presses[0]}"
    full = {row["task"]: row["perplexity"] for row in rows if row["method"] == first and row["ratio"] == 0.0
            and "perplexity" in row}  # fmt: skip
    names = list(tasks)
    for share in shares:
        for press in presses:
            method = f"kvpress {press}"
            found = {row["task"]: row["perplexity"] for row in rows
                     if row["method"] == method and row["ratio"] == share and "perplexity" in row}  # fmt: skip
            rises = [100 * (found[name] / full[name] - 1) for name in names]
            cells = " ".join(f"{rise:>+14.2f}" for rise in rises)
            print(f"{f'-{share:.0%}':>7s} {press[:18]:>18} {cells} {statistics.fmean(rises):>+7.2f} "
                  f"{max(rises):>+7.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
