"""Runs inside a separate virtualenv with NVIDIA's kvpress (which pins transformers < 5.3).

    python _kvpress_runner.py MODEL_DIR TOKENS_JSON RATIO [RATIO ...]

TOKENS_JSON holds {"context": [...], "continuation": [...]}. For each press and ratio it prefills
the context through the press, scores the whole continuation in one forward pass with explicit
position ids, and prints one JSON object {press: {ratio: perplexity}} on the last line.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from kvpress import KnormPress, ObservedAttentionPress, SnapKVPress, StreamingLLMPress, TOVAPress
from transformers import AutoModelForCausalLM, DynamicCache

PRESSES = {
    "SnapKV": SnapKVPress,
    "TOVA": TOVAPress,
    "ObservedAttention": ObservedAttentionPress,
    "StreamingLLM": StreamingLLMPress,
    "Knorm": KnormPress,
}


def continuation_perplexity(model, press, context: torch.Tensor, continuation: torch.Tensor) -> float:
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        prefill = model(context, past_key_values=cache)
    positions = torch.arange(context.shape[1], context.shape[1] + continuation.shape[1]).unsqueeze(0)
    with torch.no_grad():
        logits = model(continuation, past_key_values=cache, position_ids=positions).logits
    logits = torch.cat([prefill.logits[:, -1:], logits[:, :-1]], dim=1).float()
    nll = torch.nn.functional.cross_entropy(logits[0], continuation[0])
    return math.exp(nll.item())


def main() -> None:
    model_dir, tokens_path, *ratios = sys.argv[1:]
    tokens = json.loads(Path(tokens_path).read_text())
    context = torch.tensor([tokens["context"]])
    continuation = torch.tensor([tokens["continuation"]])
    results = {}
    for name, press_class in PRESSES.items():
        implementation = "eager" if name == "ObservedAttention" else "sdpa"
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=implementation).eval()
        results[name] = {
            ratio: continuation_perplexity(model, press_class(compression_ratio=float(ratio)), context, continuation)
            for ratio in ratios
        }
        print(name, results[name], file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
