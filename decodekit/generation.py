"""From prompts to generated text: encode (with the chat template when the model has one), run
``model.generate`` with a Strategy, decode only the new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from decodekit._validation import check_int
from decodekit.plan import GenerationPlan
from decodekit.settings import DEFAULT_SYSTEM_PROMPT
from decodekit.strategies import Strategy


def check_prompts(prompts: Sequence[str]) -> list[str]:
    """Return the prompts as a list, or raise ValueError naming what is wrong."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a sequence of strings")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise TypeError(f"prompts[{index}] must be a string; got {type(prompt).__name__}")
        if not prompt.strip():
            raise ValueError(f"prompts[{index}] is empty: a prompt needs some text")
    return prompts


def check_max_new_tokens(max_new_tokens: int) -> int:
    """Return ``max_new_tokens`` if it is an integer >= 1, else raise ValueError."""
    return check_int("max_new_tokens", max_new_tokens, 1)


def uses_chat_template(tokenizer: Any, chat: bool | None) -> bool:
    """Whether prompts go through the chat template: by default, when the tokenizer has one."""
    if chat is None:
        return bool(getattr(tokenizer, "chat_template", None))
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat=True but this tokenizer has no chat template: send raw prompts (chat=False)")
    return chat


def encode_prompts(
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    chat: bool | None = None,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
) -> dict[str, torch.Tensor]:
    """Tokenize prompts into a left-padded batch (``input_ids`` and ``attention_mask``).

    With the chat template each prompt becomes one user turn, after ``system_prompt`` when it is
    a non-empty string (None or "" leaves the template's own default), followed by the
    assistant header.

    Example (with a tokenizer from ``load_model``)::

        batch = encode_prompts(tokenizer, ["Hi", "Tell me a story"])
        output = model.generate(**batch, max_new_tokens=16)
    """
    prompts = check_prompts(prompts)
    if uses_chat_template(tokenizer, chat):
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        texts = [
            tokenizer.apply_chat_template(
                [*system, {"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            for prompt in prompts
        ]
        encoded = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    else:
        encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def prepare(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    strategy: Strategy | None = None,
    *,
    chat: bool | None = None,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    row_seeds: Sequence[int] | None = None,
) -> tuple[dict[str, torch.Tensor], GenerationPlan]:
    """The encoded batch (on the model's device) and the strategy's plan for it.

    Example (with ``model`` and ``tokenizer`` from ``load_model``)::

        batch, plan = prepare(model, tokenizer, ["Hi"], Strategy(kv_budget=64))
        output = model.generate(**batch, max_new_tokens=32, **plan.generate_kwargs())
        print(plan.cache.memory_bytes())
    """
    strategy = strategy or Strategy()
    batch = encode_prompts(tokenizer, prompts, chat=chat, system_prompt=system_prompt)
    batch = {key: value.to(model.device) for key, value in batch.items()}
    plan = strategy.plan(model, tokenizer=tokenizer, attention_mask=batch["attention_mask"], row_seeds=row_seeds)
    return batch, plan


def generate_text(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    strategy: Strategy | None = None,
    *,
    max_new_tokens: int = 128,
    chat: bool | None = None,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    row_seeds: Sequence[int] | None = None,
    **generate_kwargs: Any,
) -> list[str]:
    """Generate a continuation for each prompt with ``strategy`` and return the new text only.

    ``row_seeds`` (one integer per prompt) makes a sampling strategy draw each prompt from its
    own seed, so its text does not depend on the batch (see ``Strategy.plan``). Extra keyword
    arguments go to ``model.generate`` (a ``streamer``, ``logits_processor``, which run after
    the strategy's own...).

    Example:
        >>> from decodekit import Strategy, load_model
        >>> model, tokenizer = load_model()  # doctest: +SKIP
        >>> generate_text(model, tokenizer, ["Name a color."], Strategy(), max_new_tokens=8)  # doctest: +SKIP
        ['Blue.']
    """
    check_max_new_tokens(max_new_tokens)
    batch, plan = prepare(
        model, tokenizer, prompts, strategy, chat=chat, system_prompt=system_prompt, row_seeds=row_seeds
    )
    kwargs = plan.generate_kwargs(extra_processors=generate_kwargs.pop("logits_processor", None) or ())
    kwargs.update(generate_kwargs)
    with torch.inference_mode():
        output = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **kwargs)
    new_tokens = output[:, batch["input_ids"].shape[1] :]
    return tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
