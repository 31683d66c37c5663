"""Runs inside a separate virtualenv with NVIDIA's kvpress (which pins transformers < 5.3).

    python _kvpress_runner.py MODEL_DIR TASKS_JSON OUT_JSONL [PRESS ...]

TASKS_JSON holds {"ratios": [...], "texts": {name: {"context": [...], "continuation": [...]}},
"pass_keys": [{"context": [...], "question": [...], "answer": "12345"}]} as token ids. For each
press and ratio it prefills each context through the press, then scores the text's continuation
in one forward pass (perplexity), or asks the pass-key question and decodes greedily with no
further compression (exact match). Each result is appended to OUT_JSONL as it comes, one JSON
object per line, so that an interrupted run keeps what it measured.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from kvpress import (
    AdaKVPress,
    CompactorPress,
    CriticalAdaKVPress,
    CURPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    KVzipPress,
    LeverageScorePress,
    ObservedAttentionPress,
    PyramidKVPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

# name -> (builder from a compression ratio, attention implementation it needs)
PRESSES = {
    "KVzip": (lambda r: KVzipPress(compression_ratio=r), "sdpa"),
    "AdaKV(SnapKV)": (lambda r: AdaKVPress(SnapKVPress(compression_ratio=r)), "sdpa"),
    "AdaKV(ExpectedAttention)": (lambda r: AdaKVPress(ExpectedAttentionPress(compression_ratio=r)), "sdpa"),
    "CriticalAdaKV(SnapKV)": (lambda r: CriticalAdaKVPress(SnapKVPress(compression_ratio=r)), "sdpa"),
    "PyramidKV": (lambda r: PyramidKVPress(compression_ratio=r), "sdpa"),
    "Compactor": (lambda r: CompactorPress(compression_ratio=r), "sdpa"),
    "KeyDiff": (lambda r: KeyDiffPress(compression_ratio=r), "sdpa"),
    "LeverageScore": (lambda r: LeverageScorePress(compression_ratio=r), "sdpa"),
    "CUR": (lambda r: CURPress(compression_ratio=r), "sdpa"),
    "ExpectedAttention": (lambda r: ExpectedAttentionPress(compression_ratio=r), "sdpa"),
    "SnapKV": (lambda r: SnapKVPress(compression_ratio=r), "sdpa"),
    "TOVA": (lambda r: TOVAPress(compression_ratio=r), "sdpa"),
    "ObservedAttention": (lambda r: ObservedAttentionPress(compression_ratio=r), "eager"),
    "StreamingLLM": (lambda r: StreamingLLMPress(compression_ratio=r), "sdpa"),
    "Knorm": (lambda r: KnormPress(compression_ratio=r), "sdpa"),
}


def compressed_prefill(model, press, context: torch.Tensor) -> tuple[DynamicCache, torch.Tensor, float]:
    cache = DynamicCache()
    started = time.perf_counter()
    with torch.no_grad(), press(model):
        logits = model(input_ids=context, past_key_values=cache).logits[:, -1:]
    return cache, logits, time.perf_counter() - started


def continuation_perplexity(model, press, context: torch.Tensor, continuation: torch.Tensor) -> tuple[float, float]:
    cache, last_logits, seconds = compressed_prefill(model, press, context)
    positions = torch.arange(context.shape[1], context.shape[1] + continuation.shape[1]).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=continuation, past_key_values=cache, position_ids=positions).logits
    logits = torch.cat([last_logits, logits[:, :-1]], dim=1).float()
    nll = torch.nn.functional.cross_entropy(logits[0], continuation[0])
    return math.exp(nll.item()), seconds


def pass_key_answer(model, tokenizer, press, context: torch.Tensor, question: torch.Tensor) -> str:
    cache, _, _ = compressed_prefill(model, press, context)
    ids = torch.cat([context, question], dim=1)
    with torch.no_grad():
        output = model.generate(
            ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=7, do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    return tokenizer.decode(output[0, ids.shape[1] :])


def main() -> None:
    model_dir, tasks_path, out_path, *chosen = sys.argv[1:]
    unknown = [name for name in chosen if name not in PRESSES]
    if unknown:
        raise SystemExit(f"unknown presses {unknown}; choose from {list(PRESSES)}")
    tasks = json.loads(Path(tasks_path).read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = Path(out_path)
    for name in chosen or list(PRESSES):
        build, implementation = PRESSES[name]
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=implementation).eval()
        for ratio in tasks["ratios"]:
            rows = []
            try:
                for text, task in tasks["texts"].items():
                    context, continuation = torch.tensor([task["context"]]), torch.tensor([task["continuation"]])
                    value, seconds = continuation_perplexity(model, build(ratio), context, continuation)
                    rows.append({"task": text, "perplexity": value, "prefill_s": seconds})
                hits = 0
                for task in tasks["pass_keys"]:
                    answer = pass_key_answer(
                        model,
                        tokenizer,
                        build(ratio),
                        torch.tensor([task["context"]]),
                        torch.tensor([task["question"]]),
                    )
                    hits += task["answer"] in answer
                rows.append({"task": "pass key", "accuracy": hits / max(len(tasks["pass_keys"]), 1)})
            except Exception as error:  # a press that does not run here is reported, not fatal
                rows = [{"task": "error", "error": f"{type(error).__name__}: {error}"[:500]}]
            with out.open("a") as handle:
                for row in rows:
                    handle.write(json.dumps({"method": f"kvpress {name}", "ratio": ratio, **row}) + "\n")
            print(name, ratio, rows, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
