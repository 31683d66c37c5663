"""Perplexity throughput of decodekit's metric against the algorithm of evaluate's canonical one.

    python benchmarks/eval.py [--rounds 3] [--texts 64]

evaluate's ``perplexity`` metric lives on the Hub, so its algorithm is reproduced here as it is
written there: tokenize all texts padded to the longest, prepend BOS, run fixed batches, average
the masked token losses per text. Both score the same texts (real sentences from the standard
library's documentation, each shorter than the window) on the default model; the script prints
tokens/s of each, their ratio (target: decodekit >= 1.0x) and the largest per-text difference.
"""

from __future__ import annotations

import argparse
import re

import torch
from _timing import interleaved_medians, verdict  # benchmarks/ is on sys.path when a script in it runs

from decodekit import load_model
from decodekit.eval import perplexity


def sample_texts(count: int) -> list[str]:
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for text in topics.values() for p in re.split(r"\n\s*\n", text)]
    prose = [" ".join(p.split()) for p in paragraphs if 80 <= len(p) <= 1200 and not p.startswith(("*", "|", ">>>"))]
    return prose[:count]


def canonical_perplexity(texts, model, tokenizer, batch_size: int) -> list[float]:
    """evaluate's canonical perplexity algorithm (add_start_token=True, no truncation)."""
    encodings = tokenizer(texts, add_special_tokens=False, padding=True, padding_side="right", return_tensors="pt")
    loss = torch.nn.CrossEntropyLoss(reduction="none")
    values = []
    for start in range(0, len(texts), batch_size):
        ids = encodings["input_ids"][start : start + batch_size]
        mask = encodings["attention_mask"][start : start + batch_size]
        bos = torch.full((ids.shape[0], 1), tokenizer.bos_token_id)
        ids, mask = torch.cat([bos, ids], dim=1), torch.cat([torch.ones_like(bos), mask], dim=1)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
        token_loss = loss(logits[:, :-1].transpose(1, 2), ids[:, 1:]) * mask[:, 1:]
        values += torch.exp(token_loss.sum(1) / mask[:, 1:].sum(1)).tolist()
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    model, tokenizer = load_model()
    texts = sample_texts(args.texts)
    tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts)
    ours = perplexity(texts, model, tokenizer, batch_size=args.batch_size).perplexities
    theirs = canonical_perplexity(texts, model, tokenizer, args.batch_size)
    gap = max(abs(a - b) / b for a, b in zip(ours, theirs, strict=True))
    times = interleaved_medians(
        {
            "canonical": lambda: canonical_perplexity(texts, model, tokenizer, args.batch_size),
            "decodekit": lambda: perplexity(texts, model, tokenizer, batch_size=args.batch_size),
        },
        rounds=args.rounds,
        warmup=0,
    )
    rate = {name: tokens / seconds for name, seconds in times.items()}
    ratio = rate["decodekit"] / rate["canonical"]
    print(f"perplexity of {len(texts)} texts ({tokens} tokens), batch {args.batch_size}, median of {args.rounds}")
    print(f"  evaluate's canonical algorithm {rate['canonical']:.0f} tokens/s")
    print(f"  decodekit                      {rate['decodekit']:.0f} tokens/s")
    print(f"  decodekit / canonical tokens/s: {ratio:.2f}x ({verdict(ratio >= 1.0)})")
    print(f"  largest relative difference of a text's perplexity: {gap:.1e}")


if __name__ == "__main__":
    main()
