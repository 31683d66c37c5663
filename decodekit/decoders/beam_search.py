"""Length-normalized beam search as a ``custom_generate`` decoder for ``model.generate``.

generate prepares everything (generation config, logits processors, stopping criteria, the cache,
the inputs repeated ``num_beams`` times) and then calls :func:`beam_search`. The search is
vectorized over batch x beams: each step runs one forward pass, one top-k over all beams'
continuations, and one host sync to decide whether to stop.

With ``length_normalization="average"`` and ``length_alpha`` equal to transformers'
``length_penalty``, it returns the same tokens and scores as transformers' built-in beam search.
It differs in two ways that do not change results: the prompt is run through the model once per
request and the cache is then copied to the beams (the built-in runs it once per beam), and it
reports its progress to an ``on_step`` observer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional
from transformers import Cache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import DynamicLayer, QuantizedLayer
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput

from decodekit._validation import check_int
from decodekit.decoders.length_normalization import LengthNormalization
from decodekit.settings import ALPHA_RANGE, EARLY_STOPPING, MAX_BEAMS

DEAD = -1.0e9  # the score that rules a candidate out; finite so that sums and top-k stay well defined


@dataclass(frozen=True)
class BeamSearchStep:
    """What an ``on_step`` observer receives after each step: the best hypothesis of every request.

    Attributes:
        step: how many tokens the running beams have generated.
        prompt_length: the (padded) prompt length; ``sequences[:, prompt_length:]`` are new tokens.
        sequences: ``[batch, prompt_length + step]``, the best hypothesis per request, finished or
            not (a finished one is padded after its end).
        scores: ``[batch]``, their length-normalized scores.
        finished: ``[batch]``, whether that best hypothesis has ended.
    """

    step: int
    prompt_length: int
    sequences: torch.Tensor
    scores: torch.Tensor
    finished: torch.Tensor


StepObserver = Callable[[BeamSearchStep], Any]


def _gather(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Pick entries along the beam dimension (dim 1) of ``[batch, beams, ...]``."""
    while indices.dim() < tensor.dim():
        indices = indices.unsqueeze(-1)
    return torch.take_along_dim(tensor, indices, dim=1)


def _normalization(kind: str, alpha: float | None, reward: float, config: GenerationConfig) -> LengthNormalization:
    if alpha is None:
        alpha = config.length_penalty
        low, high = ALPHA_RANGE
        if isinstance(alpha, (int, float)) and not low <= alpha <= high:
            raise ValueError(
                f"length_alpha must be in [{low:g}, {high:g}]; it defaults to generation_config.length_penalty, "
                f"which is {alpha}: pass length_alpha explicitly"
            )
    return LengthNormalization(kind, alpha, reward)


def _check_settings(model: Any, input_ids: torch.Tensor, config: GenerationConfig, on_step: Any) -> None:
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("decodekit's beam_search supports decoder-only models; this model is an encoder-decoder")
    if config.do_sample:
        raise ValueError(
            "do_sample=True: decodekit's beam_search is a deterministic search and does not sample beams; "
            "set do_sample=False (or drop custom_generate to use transformers' beam sampling)"
        )
    check_int("num_beams", config.num_beams, 1, maximum=MAX_BEAMS)
    check_int("num_return_sequences", config.num_return_sequences, 1)
    if config.num_return_sequences > config.num_beams:
        raise ValueError(
            f"num_return_sequences must be <= num_beams ({config.num_beams}); got {config.num_return_sequences}"
        )
    if config.early_stopping not in EARLY_STOPPING:
        raise ValueError(f"early_stopping must be True, False or 'never'; got {config.early_stopping!r}")
    if input_ids.shape[0] % config.num_beams:
        raise ValueError(
            "input_ids must hold num_beams copies of each prompt: call beam_search through "
            "model.generate(..., custom_generate=beam_search)"
        )
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step must be a callable taking a BeamSearchStep; got {type(on_step).__name__}")


def _shares_prefill(cache: Any) -> bool:
    """Whether the prompt can be run once per request and the cache then copied to the beams."""
    if not isinstance(cache, Cache) or cache.get_seq_length() > 0:
        return False
    classes = {type(layer) for layer in cache.layers} or {cache.layer_class_to_replicate}
    return all(
        cls is not None
        and (getattr(cls, "supports_batch_repeat", False) or issubclass(cls, DynamicLayer))
        and not issubclass(cls, QuantizedLayer)
        for cls in classes
    )


def _prefill(model: Any, input_ids: torch.Tensor, config: GenerationConfig, model_kwargs: dict, num_beams: int):
    """Run the prompt through the model, once per request when the cache allows it."""
    cache = model_kwargs.get("past_key_values")
    detailed = config.output_attentions or config.output_hidden_states
    if num_beams == 1 or detailed or "inputs_embeds" in model_kwargs or not _shares_prefill(cache):
        return model._prefill(input_ids, config, model_kwargs)
    rows = input_ids.shape[0]
    once = {
        key: value[::num_beams] if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows else value
        for key, value in model_kwargs.items()
    }
    outputs = model._prefill(input_ids[::num_beams], config, once)
    cache.batch_repeat_interleave(num_beams)
    outputs.logits = outputs.logits.repeat_interleave(num_beams, dim=0)
    return outputs


def _reorder_cache(model_kwargs: dict, beam_rows: torch.Tensor) -> None:
    cache = model_kwargs.get("past_key_values")
    if cache is None:
        return
    if not hasattr(cache, "reorder_cache"):
        raise ValueError(f"past_key_values of type {type(cache).__name__} cannot be reordered for beam search")
    cache.reorder_cache(beam_rows)


@torch.no_grad()
def beam_search(
    model: Any,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    length_normalization: str = "average",
    length_alpha: float | None = None,
    length_reward: float = 0.0,
    on_step: StepObserver | None = None,
    **model_kwargs: Any,
) -> GenerateBeamDecoderOnlyOutput | torch.LongTensor:
    """Beam search whose finished hypotheses are ranked by a length-normalized score.

    Pass it to generate, with generate's usual beam arguments (``num_beams``,
    ``num_return_sequences``, ``early_stopping``, ``max_new_tokens``, ``min_new_tokens``,
    ``eos_token_id``, ``logits_processor``, ``return_dict_in_generate``, ``output_scores``) and
    these extra ones:

    Args:
        length_normalization: ``"none"``, ``"average"`` (S / L**alpha) or ``"gnmt"``
            (S / ((5 + L) / 6)**alpha); see :class:`LengthNormalization`.
        length_alpha: the exponent, in [0, 5]; defaults to ``generation_config.length_penalty`` (1.0).
        length_reward: added per generated token (S + reward * L), in [0, 10].
        on_step: called after every step with a :class:`BeamSearchStep` holding each request's
            best hypothesis so far (for example a :class:`BeamSearchStreamer`). Reading its tensors
            costs a host sync per step, so leave it None when nobody watches.

    ``early_stopping``: True stops a request once it has ``num_beams`` finished hypotheses;
    False (the default) stops when the best running beam, scored at its current length, cannot
    beat the worst finished one; ``"never"`` stops only when no running beam can beat them at any
    length up to ``max_length`` (exact as long as processors only lower log-probabilities).

    Logits processors see log-probabilities (log-softmax of the logits), as in transformers'
    beam search. The output is generate's: token ids, or with ``return_dict_in_generate=True`` a
    ``GenerateBeamDecoderOnlyOutput`` whose ``sequences_scores`` are the normalized scores (even
    without ``output_scores=True``, which adds the per-step processed log-probabilities).

    Example (with a model and a batch from ``load_model`` and ``encode_prompts``)::

        from decodekit.decoders import beam_search
        output = model.generate(**batch, custom_generate=beam_search, num_beams=4,
                                length_normalization="gnmt", length_alpha=0.6, max_new_tokens=64)
    """
    config = generation_config
    _check_settings(model, input_ids, config, on_step)
    rule = _normalization(length_normalization, length_alpha, length_reward, config)
    try:
        return _search(model, input_ids, logits_processor, stopping_criteria, config, rule, on_step, model_kwargs)
    finally:
        if on_step is not None and hasattr(on_step, "end"):
            on_step.end()


def _search(
    model: Any,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    config: GenerationConfig,
    rule: LengthNormalization,
    on_step: StepObserver | None,
    model_kwargs: dict,
) -> GenerateBeamDecoderOnlyOutput | torch.LongTensor:
    device = input_ids.device
    num_beams, max_length = config.num_beams, config.max_length
    early_stopping = config.early_stopping
    batch_size = input_ids.shape[0] // num_beams
    prompt_length = cur_len = input_ids.shape[1]
    eos = config._eos_token_tensor
    pad = config._pad_token_tensor
    fill = pad if pad is not None else (eos[0] if eos is not None and eos.numel() else 0)
    # Keep enough candidates that num_beams of them survive even if every EOS id is among the best.
    n_eos = eos.numel() if eos is not None else 0
    n_candidates = max(2, 1 + n_eos) * num_beams
    may_finish = torch.arange(n_candidates, device=device) < num_beams  # only the best num_beams can end a hypothesis
    batch_offset = torch.arange(batch_size, device=device).view(-1, 1) * num_beams
    rows_in_order = torch.arange(batch_size * num_beams, device=device)

    running = torch.full((batch_size, num_beams, max_length), fill, dtype=torch.long, device=device)
    running[:, :, :cur_len] = input_ids.view(batch_size, num_beams, cur_len)
    running_scores = torch.zeros((batch_size, num_beams), dtype=torch.float, device=device)
    running_scores[:, 1:] = DEAD  # the beams start identical: expand only the first one
    running_origin = torch.full(
        (batch_size, num_beams, max_length - prompt_length), -1, dtype=torch.int32, device=device
    )
    finished = running.clone()
    finished_scores = torch.full((batch_size, num_beams), DEAD, dtype=torch.float, device=device)
    finished_origin = running_origin.clone()
    is_finished = torch.zeros((batch_size, num_beams), dtype=torch.bool, device=device)
    can_improve = torch.ones((batch_size, 1), dtype=torch.bool, device=device)

    want = config.return_dict_in_generate
    step_scores: tuple | None = () if want and config.output_scores else None
    step_logits: tuple | None = () if want and config.output_logits else None
    attentions: tuple | None = () if want and config.output_attentions else None
    hidden_states: tuple | None = () if want and config.output_hidden_states else None

    outputs = _prefill(model, input_ids, config, model_kwargs, num_beams)
    while True:
        model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
        logits = outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32, device=device)
        flat_running = running[:, :, :cur_len].reshape(batch_size * num_beams, cur_len)
        log_probs = logits_processor(flat_running, functional.log_softmax(logits, dim=-1))
        if step_logits is not None:
            step_logits += (logits.clone(),)
        if step_scores is not None:
            step_scores += (log_probs.clone(),)
        if attentions is not None:
            attentions += (outputs.attentions,)
        if hidden_states is not None:
            hidden_states += (outputs.hidden_states,)
        del outputs

        # a. the best continuations over all beams of a request
        vocab_size = log_probs.shape[-1]
        totals = (log_probs.view(batch_size, num_beams, vocab_size) + running_scores[:, :, None]).view(batch_size, -1)
        cand_scores, cand_index = torch.topk(totals, n_candidates)
        cand_beam = cand_index // vocab_size
        cand = _gather(running, cand_beam)
        cand[:, :, cur_len] = cand_index % vocab_size
        cand_origin = _gather(running_origin, cand_beam)
        cand_origin[:, :, cur_len - prompt_length] = (cand_beam + batch_offset).to(torch.int32)
        cand_ends = stopping_criteria(cand[:, :, : cur_len + 1].reshape(-1, cur_len + 1), step_scores)
        cand_ends = cand_ends.view(batch_size, n_candidates)

        # b. the num_beams best candidates that go on
        live_scores = cand_scores + cand_ends.to(torch.float32) * DEAD
        keep = torch.topk(live_scores, num_beams).indices
        running, running_scores, running_origin = (
            _gather(cand, keep),
            _gather(live_scores, keep),
            _gather(cand_origin, keep),
        )

        # c. the candidates that end here join the finished hypotheses if they score high enough
        ending = cand_ends & may_finish
        scores = rule(cand_scores, cur_len + 1 - prompt_length)
        scores += (is_finished.all(dim=-1, keepdim=True) & (early_stopping is True)).to(torch.float32) * DEAD
        scores += (~can_improve).to(torch.float32) * DEAD
        scores += (~ending) * DEAD
        best = torch.topk(torch.cat((finished_scores, scores), dim=1), num_beams).indices
        finished = _gather(torch.cat((finished, cand), dim=1), best)
        finished_scores = _gather(torch.cat((finished_scores, scores), dim=1), best)
        finished_origin = _gather(torch.cat((finished_origin, cand_origin), dim=1), best)
        is_finished = _gather(torch.cat((is_finished, ending), dim=1), best)

        beam_rows = running_origin[:, :, cur_len - prompt_length].flatten().to(torch.long)
        cur_len += 1

        # d. can a running beam still beat the finished ones?
        if early_stopping == "never" and rule.favours_length:
            best_length = max_length - prompt_length
        else:
            best_length = cur_len - prompt_length
        best_possible = rule(running_scores[:, :1], best_length)
        worst_finished = torch.where(is_finished, finished_scores.min(dim=1, keepdim=True).values, DEAD)
        can_improve = can_improve & (best_possible > worst_finished).any(dim=-1, keepdim=True)

        if on_step is not None:
            on_step(_best_so_far(rule, cur_len, prompt_length, running, running_scores, finished, finished_scores))
        all_full = is_finished.all() & (early_stopping is True)
        go_on = can_improve.any() & ~all_full & ~cand_ends.all()
        # The one host sync of the step: whether to go on, and whether the beams kept their rows
        # (then the cache needs no reordering).
        go_on, in_place = torch.stack((go_on, (beam_rows == rows_in_order).all())).tolist()
        if not in_place:
            _reorder_cache(model_kwargs, beam_rows)
        if not go_on:
            break
        flat_running = running[:, :, :cur_len].reshape(batch_size * num_beams, cur_len)
        next_length = 1 if model_kwargs.get("use_cache", True) else None
        inputs = model.prepare_inputs_for_generation(flat_running, next_sequence_length=next_length, **model_kwargs)
        outputs = model(**inputs, return_dict=True)

    return _outputs(
        config, prompt_length, finished, finished_scores, finished_origin, model_kwargs,
        step_scores, step_logits, attentions, hidden_states,
    )  # fmt: skip


def _best_so_far(
    rule: LengthNormalization,
    cur_len: int,
    prompt_length: int,
    running: torch.Tensor,
    running_scores: torch.Tensor,
    finished: torch.Tensor,
    finished_scores: torch.Tensor,
) -> BeamSearchStep:
    """Each request's best hypothesis: its best finished one, unless the top running beam scores higher."""
    running_best = rule(running_scores[:, 0], cur_len - prompt_length)
    use_finished = finished_scores[:, 0] >= running_best
    sequences = torch.where(use_finished[:, None], finished[:, 0, :cur_len], running[:, 0, :cur_len])
    scores = torch.where(use_finished, finished_scores[:, 0], running_best)
    return BeamSearchStep(cur_len - prompt_length, prompt_length, sequences, scores, use_finished)


def _outputs(
    config: GenerationConfig,
    prompt_length: int,
    finished: torch.Tensor,
    finished_scores: torch.Tensor,
    finished_origin: torch.Tensor,
    model_kwargs: dict,
    step_scores: tuple | None,
    step_logits: tuple | None,
    attentions: tuple | None,
    hidden_states: tuple | None,
) -> GenerateBeamDecoderOnlyOutput | torch.LongTensor:
    """The best ``num_return_sequences`` per request, cropped to the longest of them."""
    keep = config.num_return_sequences
    sequences = finished[:, :keep].flatten(0, 1)
    origin = finished_origin[:, :keep].flatten(0, 1)
    generated = int((origin >= 0).sum(dim=1).max())
    sequences = sequences[:, : prompt_length + generated]
    if not config.return_dict_in_generate:
        return sequences
    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=finished_scores[:, :keep].flatten(),  # the built-in needs output_scores=True for these
        scores=step_scores,
        logits=step_logits,
        beam_indices=origin[:, :generated],
        attentions=attentions,
        hidden_states=hidden_states,
        past_key_values=model_kwargs.get("past_key_values"),
    )
