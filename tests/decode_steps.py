"""Decoding by hand for the cache's step tests: the prompt they share, and greedy steps after its pass."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def prompt_batch(tokenizer, rows: int = 1, padded: bool = False) -> dict[str, torch.Tensor]:
    """``rows`` copies of a 186-token prompt, or (``padded``) it and its first half, left-padded."""
    text = "The class statement creates a new class object and binds it to a name. " * 6
    texts = [text, text[: len(text) // 2]] if padded else [text] * rows
    return tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")


def decode_by_hand(model, cache, batch, steps: int, recorder: TorchDispatchMode | None = None) -> list[torch.Tensor]:
    """Greedy decoding by hand; the steps after the prompt's pass run under ``recorder``.
    Returns each step's chosen tokens."""
    mask = batch["attention_mask"]
    with torch.no_grad():
        logits = model(**batch, past_key_values=cache).logits[:, -1]
        chosen = []
        for _ in range(steps):
            token = logits.argmax(dim=-1, keepdim=True)
            chosen.append(token)
            mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
            positions = (mask.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
            step = {"input_ids": token, "attention_mask": mask, "position_ids": positions, "past_key_values": cache}
            if recorder is None:
                logits = model(**step).logits[:, -1]
            else:
                with recorder:
                    logits = model(**step).logits[:, -1]
    return chosen


def greedy_steps(model, cache, batch, steps: int, record: Callable) -> list[tuple[torch.Tensor, object]]:
    """Greedy steps by hand after the prompt's pass: each step's last logits and ``record(cache)`` after it."""
    mask, taken = batch["attention_mask"], []
    with torch.no_grad():
        last = model(**batch, past_key_values=cache).logits[:, -1]
        for _ in range(steps):
            token = last.argmax(dim=-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
            positions = mask.sum(dim=-1, keepdim=True) - 1
            last = model(token, attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1]
            taken.append((last, record(cache)))
    return taken


def logits_of_greedy_steps(model, cache, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy steps by hand after ``prompt`` (``[rows, tokens]``, no padding) through ``cache``: the logits of every
    step, ``[rows, steps, vocab]``."""
    logits = []
    with torch.no_grad():
        token = model(prompt, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
        for step in range(steps):
            position = torch.full((prompt.shape[0], 1), prompt.shape[1] + step)
            out = model(token, past_key_values=cache, position_ids=position, cache_position=position[0]).logits
            logits.append(out)
            token = out[:, -1:].argmax(dim=-1)
    return torch.cat(logits, dim=1)


def assert_same_entries(ours, theirs) -> None:
    """Two caches' layers hold the same lengths and, in every valid slot, the same bytes in every field."""
    for layer, other in zip(ours.layers, theirs.layers, strict=True):
        assert (layer.storage.lengths_host == other.storage.lengths_host).all()
        valid = layer.storage.valid(layer.longest)
        for name in layer.storage.fields:
            stored, expected = layer.storage.read(name, layer.longest), other.storage.read(name, layer.longest)
            assert torch.equal(stored[valid], expected[valid]), name
