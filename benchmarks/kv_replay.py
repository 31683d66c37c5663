"""Ablation: how a reconstruction-scoring cache replays its prompt, measured on the tuning texts only.

Each row scores the prompt by replaying it a different way (CompressedCache's replay options), then keeps
what one ranking of every (layer, KV head, token) score keeps (the heads sharing one budget, as
``allocation="heads"`` keeps them), and scores the continuation over what was kept:

- plain: the prompt fed again in chunks (the default replay);
- prompt: each chunk after an instruction to repeat the text, in the model's chat turn (KVzip's
  "Repeat the previous context exactly.", then the chat template's end of the user turn);
- prompt + overlap: as above, each chunk after the first starting with the previous chunk's last 8 tokens;
- chunk scope: a chunk's attention spread over the sinks, its own span of the prompt and itself only;
- KVzip's replay: prompt, overlap and chunk scope together;
- output norms: the plain replay with KVzip+'s weighting (each replay query's attention to an entry times the
  norm of what the entry writes through the output projection, over the query's hidden-state norm);
- KVzip+: KVzip's replay with that weighting.

Each row is measured with the per-head floor of ``allocation="heads"`` (each head keeps at least
``--floors`` of the even share) and with none (KVzip keeps no floor). The replay runs once per text and row; each
ratio and floor then masks a copy of the scored cache; ``--with-cache`` adds, per row, the evicting
``CompressedCache(allocation="heads", matched_layers=0)`` itself, which keeps what the masks at the 20% floor keep
(the masks measure which tokens are kept, so the cache's first layer is not refit here).

    python benchmarks/kv_replay.py [--ratios 0.5,0.75,0.9] [--rows "plain;KVzip's replay"] [--floors 0.2,0]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from kv_allocation import allocate, masked_perplexity, scored_prompt
from kv_protocol import add_tuning_texts_argument, text_tasks

from decodekit import load_model
from decodekit.cache import CompressedCache
from decodekit.eval.perplexity import continuation_perplexity

REPEAT = "\n\nRepeat the previous context exactly."
OVERLAP = 8  # KVzip's overlap between chunks


def chat_turn_end(tokenizer) -> list[int]:
    """The token ids a chat template puts between a user's message and the assistant's answer (``"\\n"`` for a
    model without a template)."""
    if tokenizer.chat_template is None:
        return tokenizer.encode("\n", add_special_tokens=False)
    marker = "\x00MESSAGE-END\x00"
    turn = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(turn.split(marker, 1)[1], add_special_tokens=False)


def row_options(tokenizer) -> dict[str, dict]:
    """The replay options of each row."""
    prefix = tokenizer.encode(REPEAT, add_special_tokens=False) + chat_turn_end(tokenizer)
    return {
        "plain": {"replay": "forward"},
        "prompt": {"replay_prefix": prefix},
        "prompt + overlap": {"replay_prefix": prefix, "replay_overlap": OVERLAP},
        "chunk scope": {"replay_scope": "chunk"},
        "KVzip's replay": {"replay_prefix": prefix, "replay_overlap": OVERLAP, "replay_scope": "chunk"},
        "output norms": {"replay_output_norms": True},
        "KVzip+": {
            "replay_prefix": prefix,
            "replay_overlap": OVERLAP,
            "replay_scope": "chunk",
            "replay_output_norms": True,
        },
        "prompt queries": {"replay": "prompt_queries"},
    }


def chosen_rows(tokenizer, names: list[str] | None) -> dict[str, dict]:
    """The replay options of the rows named (all when ``names`` is None); ValueError naming any unknown row."""
    options = row_options(tokenizer)
    unknown = sorted(set(names or ()) - set(options))
    if unknown:
        raise ValueError(f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(map(repr, options))}")
    return {name: options[name] for name in names} if names else options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-tokens", type=int, default=3072)
    parser.add_argument("--continuation-tokens", type=int, default=512)
    parser.add_argument("--ratios", default="0.5,0.75,0.9")
    add_tuning_texts_argument(parser)
    parser.add_argument("--floors", default="0.2,0", help="per-head floors, shares of the even share")
    parser.add_argument("--rows", help="the rows to measure, separated by ';' (default: all)")
    parser.add_argument("--chunk", type=int, default=2048, help="prompt tokens per replayed chunk")
    parser.add_argument("--with-cache", action="store_true", help="also run the evicting cache itself, per row")
    args = parser.parse_args()
    model, tokenizer = load_model()
    tasks = text_tasks(tokenizer, args.texts, args.context_tokens, args.continuation_tokens)
    ratios = [float(value) for value in args.ratios.split(",")]
    floors = [float(value) for value in args.floors.split(",")]
    try:
        options = chosen_rows(tokenizer, args.rows.split(";") if args.rows else None)
    except ValueError as error:
        parser.error(f"--rows: {error}")
    rows = list(options)
    print(f"tuning texts ({', '.join(tasks)}): {args.context_tokens}-token contexts, "
          f"{args.continuation_tokens}-token continuations, {args.chunk}-token replay chunks; "
          "mean (worst) perplexity increase over the full cache; heads share one budget", flush=True)  # fmt: skip
    print(f"  {'replay':18s}{'floor':>7s}" + "".join(f"{f'{ratio:.0%} evicted':>22s}" for ratio in ratios))
    for row in rows:
        increases = {(floor, ratio): [] for floor in (*floors, "cache") for ratio in ratios}
        for task in tasks.values():
            context, continuation = torch.tensor([task["context"]]), torch.tensor([task["continuation"]])
            scored = scored_prompt(model, context, "reconstruction", reconstruction_chunk=args.chunk, **options[row])
            full = masked_perplexity(model, scored, continuation, None)
            priorities = [layer.priority(layer.longest)[0] for layer in scored[0].layers]
            for floor in floors:
                for ratio in ratios:
                    masks = allocate(priorities, ratio, "global", floor)
                    increases[floor, ratio].append(masked_perplexity(model, scored, continuation, masks) / full - 1)
            for ratio in ratios if args.with_cache else ():
                cache = CompressedCache(
                    model, compression_ratio=ratio, scoring="reconstruction", reconstruction_chunk=args.chunk,
                    matched_layers=0, **options[row],  # what the masks keep, not refit
                )  # fmt: skip
                evicting = continuation_perplexity(model, cache, context, continuation)
                increases["cache", ratio].append(evicting / full - 1)
        for floor in (*floors, "cache") if args.with_cache else floors:
            cells = [increases[floor, ratio] for ratio in ratios]
            text = "".join(f"{f'{statistics.fmean(cell):+8.2%} ({max(cell):+7.2%})':>22s}" for cell in cells)
            label = "cache" if floor == "cache" else f"{floor:.0%}"
            print(f"  {row:18s}{label:>7s}" + text, flush=True)


if __name__ == "__main__":
    main()
