"""decodekit's beam search against transformers' built-in one, a teacher-forced scoring oracle,
and the settings users pass through generate."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from decodekit import FrequencyPresencePenaltyLogitsProcessor, StagedRepetitionPenaltyLogitsProcessor, Strategy
from decodekit.decoders import HUB_FOLDER, BeamSearchStreamer, LengthNormalization, beam_search

PROMPTS = ["def foo", "The class statement creates", "x"]
# The published formulas, written out independently of decodekit's LengthNormalization.
LENGTH_TERMS = {
    "none": lambda length, alpha: 1.0,
    "average": lambda length, alpha: length**alpha,
    "gnmt": lambda length, alpha: ((5 + length) / 6) ** alpha,
}


@pytest.fixture(scope="module")
def batches(tiny):
    _, tokenizer = tiny
    padded = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    single = {key: value[:1] for key, value in padded.items()}
    return {"single": single, "padded": padded}


@pytest.fixture(scope="module")
def frequent_tokens(tiny, batches):
    """Tokens the tiny model emits often: used as extra EOS ids so that hypotheses end early."""
    model, tokenizer = tiny
    batch = batches["padded"]
    output = model.generate(**batch, max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    ids, counts = output[:, batch["input_ids"].shape[1] :].flatten().unique(return_counts=True)
    return ids[counts.argsort(descending=True)][:3].tolist()


def _both(model, batch, **kwargs):
    """(built-in output, decodekit's output) for the same generate arguments."""
    kwargs = {"return_dict_in_generate": True, "output_scores": True, **kwargs}
    return model.generate(**batch, **kwargs), model.generate(**batch, custom_generate=beam_search, **kwargs)


def _assert_same(built_in, ours):
    assert torch.equal(ours.sequences, built_in.sequences)
    torch.testing.assert_close(ours.sequences_scores, built_in.sequences_scores, atol=1e-4, rtol=0)
    assert torch.equal(ours.beam_indices.long(), built_in.beam_indices.long())
    assert len(ours.scores) == len(built_in.scores)
    for step_ours, step_built_in in zip(ours.scores, built_in.scores, strict=True):
        torch.testing.assert_close(step_ours, step_built_in, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("num_beams", "early_stopping", "length_penalty"),
    list(itertools.product((2, 4, 8), (False, True, "never"), (0.0, 1.0, 2.0))),
)
@pytest.mark.parametrize("batch_name", ["single", "padded"])
def test_average_normalization_equals_the_built_in_beam_search(
    tiny, batches, frequent_tokens, num_beams, early_stopping, length_penalty, batch_name
):
    model, tokenizer = tiny
    built_in, ours = _both(
        model,
        batches[batch_name],
        num_beams=num_beams,
        num_return_sequences=2,
        early_stopping=early_stopping,
        length_penalty=length_penalty,
        eos_token_id=[tokenizer.eos_token_id, *frequent_tokens],
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=16,
    )
    _assert_same(built_in, ours)


def test_the_comparison_covers_hypotheses_that_end_early(tiny, batches, frequent_tokens):
    model, tokenizer = tiny
    batch = batches["padded"]
    eos = [tokenizer.eos_token_id, *frequent_tokens]
    output = model.generate(
        **batch, custom_generate=beam_search, num_beams=4, eos_token_id=eos, pad_token_id=0, max_new_tokens=16
    )
    new_tokens = output[:, batch["input_ids"].shape[1] :]
    assert new_tokens.shape[1] < 16 or bool((new_tokens == 0).any())


class _StopAfterToken(StoppingCriteria):
    def __init__(self, token_id: int):
        self.token_id = token_id

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token_id


def test_min_new_tokens_processors_and_stopping_criteria_match_the_built_in(tiny, batches, frequent_tokens):
    model, tokenizer = tiny
    for min_new_tokens in (0, 6):
        processors = LogitsProcessorList(
            [
                StagedRepetitionPenaltyLogitsProcessor({1: 1.3, 3: 2.0}, window=8),
                FrequencyPresencePenaltyLogitsProcessor(
                    0.4, 0.2, prompt_length=batches["padded"]["input_ids"].shape[1]
                ),
            ]
        )
        built_in, ours = _both(
            model,
            batches["padded"],
            num_beams=3,
            min_new_tokens=min_new_tokens,
            max_new_tokens=14,
            logits_processor=processors,
            stopping_criteria=StoppingCriteriaList([_StopAfterToken(frequent_tokens[0])]),
            pad_token_id=tokenizer.pad_token_id,
        )
        _assert_same(built_in, ours)


@pytest.mark.parametrize("cache", ["none", "static", "given"])
def test_other_caches_and_no_cache_match_the_built_in(tiny, batches, cache):
    model, tokenizer = tiny
    kwargs = {"num_beams": 3, "max_new_tokens": 10, "pad_token_id": tokenizer.pad_token_id}
    if cache == "none":
        kwargs["use_cache"] = False
    elif cache == "static":
        kwargs["cache_implementation"] = "static"
    built_in_kwargs, our_kwargs = dict(kwargs), dict(kwargs)
    if cache == "given":
        built_in_kwargs["past_key_values"] = DynamicCache(config=model.config)
        our_kwargs["past_key_values"] = DynamicCache(config=model.config)
    batch = batches["padded"]
    built_in = model.generate(**batch, **built_in_kwargs)
    ours = model.generate(**batch, custom_generate=beam_search, **our_kwargs)
    assert torch.equal(ours, built_in)


def test_the_prompt_runs_once_per_request_not_once_per_beam(tiny, batches):
    model, _ = tiny
    rows_seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].shape))
    try:
        model.generate(**batches["padded"], custom_generate=beam_search, num_beams=4, max_new_tokens=3, pad_token_id=0)
    finally:
        hook.remove()
    prompt_length = batches["padded"]["input_ids"].shape[1]
    assert rows_seen[0] == (3, prompt_length)
    assert all(shape == (12, 1) for shape in rows_seen[1:])


def _teacher_forced_log_prob_sum(model, prompt_ids, prompt_mask, new_ids, eos_ids):
    """The summed log-probability of ``new_ids`` after the prompt, up to and including the first EOS."""
    length = len(new_ids)
    for position, token in enumerate(new_ids):
        if token in eos_ids:
            length = position + 1
            break
    new_ids = new_ids[:length]
    ids = torch.tensor([prompt_ids + new_ids])
    mask = torch.tensor([prompt_mask + [1] * length])
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[0].float()
    log_probs = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return log_probs[torch.arange(length), torch.tensor(new_ids)].sum(), length


@pytest.mark.parametrize(
    "rule",
    [
        LengthNormalization("none"),
        LengthNormalization("average", alpha=0.5),
        LengthNormalization("gnmt", alpha=0.6),
        LengthNormalization("gnmt", alpha=1.0, reward=0.3),
        LengthNormalization("none", reward=0.5),
    ],
)
def test_returned_scores_are_the_normalized_teacher_forced_log_probabilities(tiny, batches, frequent_tokens, rule):
    model, tokenizer = tiny
    batch = batches["padded"]
    eos = [tokenizer.eos_token_id, *frequent_tokens]
    output = model.generate(
        **batch,
        custom_generate=beam_search,
        num_beams=4,
        num_return_sequences=4,
        length_normalization=rule.kind,
        length_alpha=rule.alpha,
        length_reward=rule.reward,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=12,
        return_dict_in_generate=True,
    )
    prompt_length = batch["input_ids"].shape[1]
    scores = output.sequences_scores.view(len(PROMPTS), 4)
    assert torch.all(scores[:, :-1] >= scores[:, 1:]), "hypotheses come best first"
    for row, sequence in enumerate(output.sequences):
        request = row // 4
        prompt_mask = batch["attention_mask"][request].tolist()
        log_prob_sum, length = _teacher_forced_log_prob_sum(
            model, sequence[:prompt_length].tolist(), prompt_mask, sequence[prompt_length:].tolist(), eos
        )
        expected = log_prob_sum / LENGTH_TERMS[rule.kind](length, rule.alpha) + rule.reward * length
        torch.testing.assert_close(output.sequences_scores[row], expected, atol=1e-4, rtol=1e-4)


def test_a_length_reward_makes_outputs_longer(tiny, batches, frequent_tokens):
    model, tokenizer = tiny
    batch = batches["padded"]
    eos = [tokenizer.eos_token_id, *frequent_tokens]

    def generated_length(**kwargs):
        output = model.generate(
            **batch,
            custom_generate=beam_search,
            num_beams=4,
            eos_token_id=eos,
            pad_token_id=-7,
            max_new_tokens=16,
            **kwargs,
        )
        return int((output[:, batch["input_ids"].shape[1] :] != -7).sum())

    assert generated_length(length_normalization="none", length_reward=3.0) > generated_length(
        length_normalization="none"
    )


def test_the_hub_folder_gives_the_same_output(tiny, batches):
    model, tokenizer = tiny
    kwargs = {"num_beams": 3, "max_new_tokens": 8, "pad_token_id": tokenizer.pad_token_id}
    kwargs.update(length_normalization="gnmt", length_alpha=0.6)
    direct = model.generate(**batches["padded"], custom_generate=beam_search, **kwargs)
    from_folder = model.generate(**batches["padded"], custom_generate=str(HUB_FOLDER), trust_remote_code=True, **kwargs)
    assert torch.equal(from_folder, direct)


def test_the_streamer_follows_the_search_to_its_result(tiny, batches):
    model, tokenizer = tiny
    streamer = BeamSearchStreamer(tokenizer, timeout=60)
    kwargs = {"num_beams": 3, "max_new_tokens": 6, "pad_token_id": tokenizer.pad_token_id, "on_step": streamer}
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(output=model.generate(**batches["padded"], custom_generate=beam_search, **kwargs))
    )
    worker.start()
    steps = list(streamer)
    worker.join()
    assert [progress.step for progress in steps] == list(range(1, 7))
    final_texts = tokenizer.batch_decode(
        result["output"][:, batches["padded"]["input_ids"].shape[1] :], skip_special_tokens=True
    )
    assert steps[-1].texts == final_texts
    assert all(steps[-1].finished)


def test_the_streamer_ends_when_the_search_fails(tiny, batches):
    model, tokenizer = tiny

    class Broken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            raise RuntimeError("broken criterion")

    streamer = BeamSearchStreamer(tokenizer, timeout=60)
    errors = []

    def run():
        try:
            model.generate(
                **batches["single"],
                custom_generate=beam_search,
                num_beams=2,
                max_new_tokens=4,
                pad_token_id=0,
                on_step=streamer,
                stopping_criteria=StoppingCriteriaList([Broken()]),
            )
        except RuntimeError as error:
            errors.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    assert list(streamer) == []
    worker.join()
    assert errors


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_beams": 2, "do_sample": True}, ValueError, "do_sample=True.*does not sample"),
        ({"num_beams": 2, "length_normalization": "log"}, ValueError, "length_normalization must be one of"),
        ({"num_beams": 2, "length_alpha": -0.5}, ValueError, r"length_alpha must be a number in \[0, 5\]"),
        ({"num_beams": 2, "length_reward": float("nan")}, ValueError, "length_reward must be"),
        ({"num_beams": 2, "length_penalty": -1.0}, ValueError, "defaults to generation_config.length_penalty"),
        ({"num_beams": 0}, ValueError, r"num_beams must be an integer in \[1, 256\]"),
        ({"num_beams": 2, "num_return_sequences": 3}, ValueError, "num_return_sequences"),
        ({"num_beams": 2, "on_step": "progress"}, TypeError, "on_step must be a callable"),
    ],
)
def test_bad_settings_are_named(tiny, batches, kwargs, error, message):
    model, _ = tiny
    with pytest.raises(error, match=message):
        model.generate(**batches["single"], custom_generate=beam_search, max_new_tokens=4, pad_token_id=0, **kwargs)


def test_a_beam_strategy_runs_decodekits_beam_search(tiny, batches):
    model, tokenizer = tiny
    strategy = Strategy(num_beams=3, length_normalization="gnmt", length_alpha=0.6, early_stopping="never")
    kwargs = {"max_new_tokens": 8, "pad_token_id": tokenizer.pad_token_id}
    via_strategy = model.generate(**batches["padded"], **strategy.generate_kwargs(model), **kwargs)
    direct = model.generate(
        **batches["padded"],
        custom_generate=beam_search,
        num_beams=3,
        length_normalization="gnmt",
        length_alpha=0.6,
        early_stopping="never",
        **kwargs,
    )
    assert torch.equal(via_strategy, direct)
