"""kv_cache.py's quality per byte: what a cache costs in memory really held, and what it loses for it.

For each share of bytes removed (of what a full cache holds in 16 bits for the context, the size a GPU
user holds), each of our options is built with ``memory_fraction = 1 - share`` (so it picks how many
tokens, and with no ``kv_bits`` how many bits, fit) and measured on the protocol texts (continuation
perplexity after the compressed context) and on natural-prose retrieval (``kv_retrieval.py``'s single-
and multi-key tasks, the context compressed before the question). kvpress presses run at the same
share of TOKENS removed; they only mask evicted tokens, so their bytes are counted as if they were
freed, which favours them.
"""

from __future__ import annotations

import statistics

import torch
from kv_bytes import measure
from kv_retrieval import answer_tasks, retrieval_tasks

from decodekit.cache import CompressedCache

BYTE_SHARES = (0.5, 0.75, 0.875, 0.9, 0.95)
# Our options, each sized by bytes; the first is the one the targets are read on.
OPTIONS = {
    "decodekit reconstruction": {"scoring": "reconstruction"},
    "decodekit default": {},
    "decodekit reconstruction 16-bit": {"scoring": "reconstruction", "kv_bits": 16},
}
# Mean perplexity rise the first option may reach, per share of bytes removed (issue targets).
TARGETS = {0.75: 0.0025, 0.9: 0.02, 0.95: 0.05}
RETRIEVAL_KINDS = ("single key", "multi key")


def retrieval(tokenizer, per_kind: int, context_tokens: int) -> list[dict]:
    """The natural-prose retrieval tasks: ``per_kind`` single-key and as many multi-key tasks."""
    return [
        task
        for kind in RETRIEVAL_KINDS
        for task in retrieval_tasks(tokenizer, kind, per_kind, context_tokens=context_tokens)
    ]


def our_rows(model, tokenizer, texts: dict, tasks: list[dict], shares) -> list[dict]:
    """Per option and share: one row per text (perplexity, bytes held as a fraction of full 16-bit) and
    one retrieval row (accuracy)."""
    rows = []
    for name, options in OPTIONS.items():
        for share in shares:
            fraction = 1.0 - share
            for text, task in texts.items():
                result = measure(model, task, fraction, {key: options[key] for key in options if key != "scoring"},
                                 options.get("scoring", "attention"))  # fmt: skip
                rows.append({"method": name, "ratio": share, "task": text, **result})
            hits = answer_tasks(model, tokenizer, tasks, lambda o=options, f=fraction: CompressedCache(
                model, memory_fraction=f, **o))  # fmt: skip
            rows.append({"method": name, "ratio": share, "task": "retrieval", "accuracy": sum(hits) / len(hits)})
            print(f"   ... {name} at {share:.1%} of the bytes removed", flush=True)
    return rows


def full_rows(model, tokenizer, texts: dict, tasks: list[dict]) -> tuple[dict[str, float], float]:
    """The full cache's perplexity per text and its retrieval accuracy."""
    perplexities = {text: measure(model, task, None, {}, "attention")["perplexity"] for text, task in texts.items()}
    hits = answer_tasks(model, tokenizer, tasks, lambda: None)
    return perplexities, sum(hits) / len(hits)


def table(rows: list[dict], full: dict[str, float]) -> dict[str, dict[float, dict]]:
    """Per method and share: mean and worst perplexity rise, retrieval accuracy, most bytes held."""
    cells: dict[str, dict[float, dict]] = {}
    for row in rows:
        cell = cells.setdefault(row["method"], {}).setdefault(row["ratio"], {"rises": [], "held": []})
        if "perplexity" in row:
            cell["rises"].append((row["perplexity"] / full[row["task"]] - 1, row["task"]))
            if "bytes" in row:
                cell["held"].append(row["bytes"])
        elif "accuracy" in row:
            cell["retrieval"] = row["accuracy"]
    for method in cells.values():
        for cell in method.values():
            if len(cell["rises"]) == len(full):
                cell["mean"] = statistics.fmean(rise for rise, _ in cell["rises"])
                cell["worst"] = max(cell["rises"])
    return cells


def report(rows: list[dict], full: dict[str, float], full_retrieval: float, shares, verdict) -> None:
    """Print the table and the targets, side by side."""
    cells = table(rows, full)
    print("   method (perplexity rise mean, worst; retrieval; bytes held / full 16-bit;"
          " presses: tokens removed, bytes as if freed)")  # fmt: skip
    print("   " + " " * 34 + "".join(f"{f'{share:.1%} removed':>31s}" for share in shares))
    for method, by_share in cells.items():
        line = ""
        for share in shares:
            cell = by_share.get(share, {})
            mean, worst = cell.get("mean"), cell.get("worst")
            line += f"{mean:+8.2%}" if mean is not None else f"{'-':>8s}"
            line += f"{worst[0]:+8.2%}" if worst is not None else f"{'-':>8s}"
            line += f"{cell['retrieval']:6.0%}" if "retrieval" in cell else f"{'-':>6s}"
            held = max(cell["held"]) if cell.get("held") else None
            line += f"{held:9.1%}" if held is not None else f"{1 - share:8.1%}*"
        print(f"   {method[:34]:34s}{line}")
    print(f"   full cache: retrieval {full_retrieval:.0%}; * a press's bytes counted as if freed")
    ours, kvzip = cells.get(next(iter(OPTIONS)), {}), cells.get("kvpress KVzip", {})
    for share in shares:
        cell = ours.get(share, {})
        if "mean" not in cell:
            continue
        parts = []
        if cell.get("held"):
            held = max(cell["held"])
            parts.append(f"held {held:.1%} of the bytes (within {1 - share:.1%}: {held <= 1 - share + 1e-9})")
        if share in TARGETS:
            met = cell["mean"] <= TARGETS[share]
            parts.append(f"mean {cell['mean']:+.2%} (target <= {TARGETS[share]:+.2%}: {verdict(met)})")
        if "worst" in kvzip.get(share, {}):
            met = cell["worst"][0] < kvzip[share]["worst"][0]
            parts.append(f"worst {cell['worst'][0]:+.2%} vs KVzip's {kvzip[share]['worst'][0]:+.2%} ({verdict(met)})")
        if "retrieval" in cell and full_retrieval > 0:
            kept = cell["retrieval"] / full_retrieval
            parts.append(f"retrieval {kept:.0%} of the full cache's (target >= 90%: {verdict(kept >= 0.9)})")
        print(f"   {share:.1%} of the bytes removed, {next(iter(OPTIONS))}: " + "; ".join(parts))


def run(model, tokenizer, texts: dict, args, press_rows, verdict) -> None:
    """Section 1b of kv_cache.py: measure ours and the presses at each share, then print."""
    shares = [float(share) for share in args.byte_shares.split(",")]
    tasks = retrieval(tokenizer, args.retrieval_tasks, args.retrieval_tokens)
    with torch.inference_mode():
        full, full_retrieval = full_rows(model, tokenizer, texts, tasks)
    print(f"\n1b. quality per byte: the same texts, and {len(tasks)} natural-prose retrieval tasks "
          f"({args.retrieval_tasks} single-key, {args.retrieval_tasks} multi-key)")  # fmt: skip
    rows = our_rows(model, tokenizer, texts, tasks, shares)
    presses = press_rows({"ratios": shares, "texts": texts, "pass_keys": tasks})
    rows += [
        {**row, "task": "retrieval"} if row.get("task") == "pass key" else row
        for row in presses
        if row["ratio"] in shares
    ]
    report(rows, full, full_retrieval, shares, verdict)
