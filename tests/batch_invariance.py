"""A harness that checks a grid of decoding recipes for batch invariance.

For each recipe and each prompt of a left-padded batch it compares the batch's row with the prompt
run alone: the processed scores of the first step (allclose) and the tokens of a short greedy run
under the recipe's processors. Rows where plain greedy decoding with a DynamicCache is not itself
batch-invariant (padding changes float rounding, and a near tie can flip) are left out: that is
the model's noise, not the recipe's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessorList

from decodekit import MinPLogitsProcessor, Strategy, encode_prompts

SAMPLING_KEYS = ("temperature", "top_k", "top_p")


@dataclass(frozen=True)
class Case:
    """One recipe: builds generate's keyword arguments for a batch whose rows are ``rows`` of the prompt set."""

    name: str
    build: Callable[[Any, dict[str, torch.Tensor], list[int]], dict[str, Any]]
    beams: int = 1


def strategy_case(name: str, strategy: Strategy) -> Case:
    def build(model, batch, rows):
        return strategy.generate_kwargs(model, attention_mask=batch["attention_mask"])

    return Case(name, build, strategy.num_beams or 1)


def _per_row_min_p(model, batch, rows):
    values = torch.tensor([0.05, 0.2, 0.1, 0.3])[torch.tensor(rows) % 4]
    processors = LogitsProcessorList([MinPLogitsProcessor(values, temperature=0.9)])
    return {"do_sample": True, "temperature": 0.9, "top_k": 0, "top_p": 1.0, "logits_processor": processors}


def grid() -> list[Case]:
    """Every processor alone and combined, per-row min-p, each beam normalization, the cache, beams + cache."""
    strategies = {
        "greedy": Strategy(),
        "staged penalty, one stage": Strategy(staged_penalty="1:1.3"),
        "staged penalty, three stages": Strategy(staged_penalty="1:1.2,3:1.5,6:2.0"),
        "staged penalty, windowed": Strategy(staged_penalty="1:1.2,3:1.5,6:2.0", penalty_window=16),
        "frequency/presence": Strategy(frequency_penalty=0.5, presence_penalty=0.3),
        "min-p": Strategy(temperature=0.8, min_p=0.1),
        "top-p": Strategy(temperature=1.0, top_p=0.9),
        "top-k": Strategy(temperature=0.7, top_k=20),
        "top-h": Strategy(temperature=1.0, top_h=0.5),
        "typical": Strategy(temperature=0.9, typical_p=0.8),
        "epsilon": Strategy(temperature=1.2, epsilon_cutoff=3e-4),
        "eta": Strategy(temperature=1.2, eta_cutoff=3e-4),
        "p-less": Strategy(temperature=1.5, p_less=2.0),
        "min-k": Strategy(temperature=1.5, min_k=1.0),
        "adaptive-p": Strategy(temperature=1.0, min_p=0.05, adaptive_p=0.4),
        "all processors": Strategy(
            temperature=0.9, min_p=0.05, staged_penalty="1:1.2,3:1.5", frequency_penalty=0.3, presence_penalty=0.2
        ),
        "beam none": Strategy(num_beams=3, length_normalization="none"),
        "beam average": Strategy(num_beams=3, length_normalization="average", length_alpha=1.0),
        "beam gnmt": Strategy(num_beams=3, length_normalization="gnmt", length_alpha=0.6),
        "kv budget": Strategy(kv_budget=40),
        "kv ratio": Strategy(kv_compression_ratio=0.5),
        "beam gnmt + kv budget": Strategy(num_beams=3, length_normalization="gnmt", length_alpha=0.6, kv_budget=40),
        "kv 4-bit budget": Strategy(kv_budget=40, kv_bits=4),
        "kv memory fraction": Strategy(kv_memory_fraction=0.5),
        "beam + kv 8-bit": Strategy(num_beams=3, kv_budget=40, kv_bits=8),
    }
    cases = [strategy_case(name, strategy) for name, strategy in strategies.items()]
    return [*cases, Case("min-p per row", _per_row_min_p)]


def _generate(model, tokenizer, batch, kwargs, *, steps: int, scores: bool):
    with torch.no_grad():
        return model.generate(
            **batch,
            max_new_tokens=steps,
            pad_token_id=tokenizer.pad_token_id,
            return_dict_in_generate=True,
            output_scores=scores,
            output_logits=scores,
            **kwargs,
        )


def _first_step_scores(output, requests: int, beams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request, the processed scores and the raw logits of the first step (beam 0: every beam is alike at
    step 1)."""
    processed, raw = output.scores[0], output.logits[0]
    return processed.view(requests, beams, -1)[:, 0].float(), raw.view(requests, beams, -1)[:, 0].float()


def _greedy_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The recipe decoded greedily: its processors still run; temperature and top-k/p do not move the argmax."""
    kwargs = {key: value for key, value in kwargs.items() if key not in SAMPLING_KEYS}
    kwargs["do_sample"] = False
    return kwargs


@dataclass
class Finding:
    case: str
    row: int
    what: str


def check(model, tokenizer, prompts: list[str], cases: list[Case] | None = None, *, steps: int = 6) -> dict[str, Any]:
    """Run every case on ``prompts`` batched and alone; return the findings and the rows compared."""
    cases = cases if cases is not None else grid()
    batch = encode_prompts(tokenizer, prompts)
    singles = [encode_prompts(tokenizer, [prompt]) for prompt in prompts]
    indices = list(range(len(prompts)))

    def plain(batch_):
        return _generate(model, tokenizer, batch_, {"do_sample": False}, steps=steps, scores=False).sequences

    width = batch["input_ids"].shape[1]
    batched_plain = plain(batch)[:, width:]
    stable = [
        row
        for row, single in enumerate(singles)
        if _same_tokens(batched_plain[row], plain(single)[0, single["input_ids"].shape[1] :], tokenizer)
    ]
    findings: list[Finding] = []
    for case in cases:
        (batched_scores, batched_raw), batched_tokens = _scores_and_tokens(
            model, tokenizer, case, batch, indices, steps
        )
        for row in stable:
            single = singles[row]
            (alone_scores, alone_raw), alone_tokens = _scores_and_tokens(model, tokenizer, case, single, [row], steps)
            noisy = not torch.equal(batched_raw[row], alone_raw[0])
            if not _close(batched_scores[row], alone_scores[0], noisy=noisy):
                findings.append(Finding(case.name, row, "first-step scores differ"))
            per_request = batched_tokens.shape[0] // len(prompts)
            if not _same_tokens(
                batched_tokens[row * per_request, width:], alone_tokens[0, single["input_ids"].shape[1] :], tokenizer
            ):
                findings.append(Finding(case.name, row, "greedy tokens differ"))
    return {"findings": findings, "stable_rows": stable}


def _scores_and_tokens(model, tokenizer, case: Case, batch, rows: list[int], steps: int):
    """The recipe's processed scores of the first step (per request) and the sequences of its greedy run. A recipe
    that decodes greedily anyway gives both in one run; a sampling recipe's scores come from a one-step run of its
    own, since its greedy run leaves out the sampling warpers."""
    kwargs = case.build(model, batch, rows)
    greedy = _greedy_kwargs(case.build(model, batch, rows))
    greedy_anyway = not kwargs.get("do_sample") and not any(key in kwargs for key in SAMPLING_KEYS)
    output = _generate(model, tokenizer, batch, greedy, steps=steps, scores=greedy_anyway)
    scored = output if greedy_anyway else _generate(model, tokenizer, batch, kwargs, steps=1, scores=True)
    return _first_step_scores(scored, len(rows), case.beams), output.sequences


def _same_tokens(batched: torch.Tensor, alone: torch.Tensor, tokenizer) -> bool:
    """The alone run's tokens, then only padding where the batch went on after this row ended."""
    length = alone.shape[0]
    return torch.equal(batched[:length], alone) and bool((batched[length:] == tokenizer.pad_token_id).all())


def _close(batched: torch.Tensor, alone: torch.Tensor, *, noisy: bool = False) -> bool:
    """Whether a row's processed scores batched and alone agree: the same tokens filtered out, the same values
    for the others. Where the model's raw logits already differ (``noisy``: padding changed their rounding), a
    filter's threshold can fall between two nearly tied tokens either way, so one token in or out is forgiven
    there; a processor that reads another row's state moves values or more tokens."""
    filtered_batched, filtered_alone = batched.isinf(), alone.isinf()
    flipped = int((filtered_batched != filtered_alone).sum())
    if flipped > (1 if noisy else 0):
        return False
    kept = ~(filtered_batched | filtered_alone)
    return torch.allclose(batched[kept], alone[kept], atol=1e-4, rtol=1e-4)
