"""The saved-cache files that ``tests/test_kv_reuse.py`` loads, one per format version read: a change to what a cache
saves must raise ``persist.VERSION`` and write its file (``python -m tests.kv_format_file``), keeping the others.

The model's weights come from integer arithmetic, the same on every machine and torch version (a random
initialization is not), so that the file's weights' fingerprint matches wherever the test runs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from decodekit.cache import CompressedCache
from decodekit.cache.persist import VERSION

FILE = Path(__file__).resolve().parent / "data" / f"kv_cache_format_v{VERSION}.kv"


def file_of(version: int) -> Path:
    """The file written by format ``version``."""
    return FILE.with_name(f"kv_cache_format_v{version}.kv")


# What each version's file was compressed with beyond ``OPTIONS``: version 1 coded keys whole, version 2 smooths them.
VERSION_OPTIONS = {1: {"smooth_keys": False}, 2: {"smooth_keys": True}}
# Coded keys and values with a residual window, a shared allocation per KV head, a refit (biased) first layer: what
# the storage holds in its most varied form.
OPTIONS = {"budget": 12, "sink_tokens": 2, "recent_tokens": 6, "scoring": "reconstruction", "allocation": "heads",
           "kv_bits": 4, "residual_length": 4, "matched_layers": 1}  # fmt: skip
DOCUMENT = [(7 * i + 3) % 61 + 2 for i in range(80)]
QUESTION = [5, 9, 14, 33]


def integer_model() -> LlamaForCausalLM:
    """A two-layer Llama whose every weight is a small rational number computed in integers."""
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for index, (name, parameter) in enumerate(sorted(model.named_parameters())):
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
                continue
            steps = torch.arange(parameter.numel(), dtype=torch.int64)
            residues = (steps * (2 * index + 37) + 11 * index) % 257 - 128  # in [-128, 128]
            parameter.copy_((residues.to(torch.float32) / 512).view_as(parameter))
    return model


def compressed(model: LlamaForCausalLM, version: int = VERSION) -> CompressedCache:
    """``DOCUMENT`` compressed with ``OPTIONS``, as format ``version``'s file was."""
    cache = CompressedCache(model, **OPTIONS, **VERSION_OPTIONS[version])
    with torch.no_grad():
        model(torch.tensor([DOCUMENT]), past_key_values=cache)
    return cache


def write() -> Path:
    model = integer_model()  # (held: the cache holds its model weakly)
    compressed(model).save(FILE, token_ids=DOCUMENT)
    return FILE


if __name__ == "__main__":
    print(write())
