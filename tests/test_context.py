"""decodekit.context: a document compressed once and asked many questions, against independent oracles (the chat
template rendered whole, transformers' own chunked prefill, generate with its own cache, a cache filled in place)."""

from __future__ import annotations

import math
from pydoc_data.topics import topics

import pytest
import torch

from decodekit import Strategy
from decodekit.cache import CompressedCache, full_cache_bytes
from decodekit.context import Context, document_ids, fill, question_ids, read_notes
from decodekit.settings import DEFAULT_SYSTEM_PROMPT
from tests.tiny import build_model

DOCUMENT = topics["assert"] + topics["pass"]
QUESTIONS = ["What does the assert statement do?", "When is pass useful?"]
OPTIONS = {"memory_fraction": 0.2, "scoring": "reconstruction"}


@pytest.fixture
def fresh(tiny):
    _, tokenizer = tiny
    return build_model(tokenizer), tokenizer


def test_a_document_and_a_question_frame_one_user_turn_of_the_chat_template(tiny):
    _, tokenizer = tiny
    ids = document_ids(tokenizer, DOCUMENT) + question_ids(tokenizer, QUESTIONS[0], chat=True)
    whole = tokenizer.apply_chat_template(
        [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": DOCUMENT + "\n\n" +
                                                                 QUESTIONS[0]}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert tokenizer.decode(ids) == whole
    raw = document_ids(tokenizer, DOCUMENT, chat=False) + question_ids(tokenizer, QUESTIONS[0], chat=False)
    assert tokenizer.decode(raw) == DOCUMENT + "\n\n" + QUESTIONS[0]
    for bad, message in [("", "document is empty"), ("  \n", "document is empty"), (3, "document must be a string")]:
        with pytest.raises((TypeError, ValueError), match=message):
            document_ids(tokenizer, bad)


def _in_place_answer(model, tokenizer, question: str, new_tokens: int = 16):
    """The oracle: the framed document in one forward pass of a fresh cache, the context ended (``end_context``: the
    question is not part of the document), then the question by generate on that cache itself (no fork, no file)."""
    ids = document_ids(tokenizer, DOCUMENT)
    cache = CompressedCache(model, **OPTIONS)
    with torch.no_grad():
        model(torch.tensor([ids]), past_key_values=cache)
        cache.end_context()
        full = torch.tensor([ids + question_ids(tokenizer, question, chat=True)])
        output = model.generate(
            full, attention_mask=torch.ones_like(full), past_key_values=cache, max_new_tokens=new_tokens,
            do_sample=False, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    return tokenizer.decode(output[0, full.shape[1] :], skip_special_tokens=True)


def test_questions_from_a_saved_context_are_answered_as_right_after_compressing_in_place(fresh, tmp_path):
    model, tokenizer = fresh
    context = Context.compress(model, tokenizer, DOCUMENT, CompressedCache(model, **OPTIONS))
    assert context.chat and context.seen == len(document_ids(tokenizer, DOCUMENT)) and context.kept < context.seen
    path = context.save(tmp_path / "doc.kv", source="topics")
    assert read_notes(path) == {"chat": True, "source": "topics"}
    loaded = Context.load(path, model)
    assert loaded.token_ids == context.token_ids and loaded.chat
    for question in QUESTIONS:  # in turn, each from its own fork
        expected = _in_place_answer(model, tokenizer, question)
        assert loaded.ask(model, tokenizer, question, max_new_tokens=16) == expected
        assert context.ask(model, tokenizer, question, max_new_tokens=16) == expected
    assert loaded.cache.get_seq_length() == context.cache.get_seq_length() == context.seen  # the documents stay


def test_a_context_answers_with_other_strategies_as_the_context_it_was_saved_from(fresh, tmp_path):
    model, tokenizer = fresh
    context = Context.compress(model, tokenizer, DOCUMENT, CompressedCache(model, **OPTIONS))
    loaded = Context.load(context.save(tmp_path / "doc.kv"), model)
    for strategy in (Strategy(num_beams=3), Strategy(temperature=0.8, top_p=0.9),
                     Strategy(staged_penalty="1:1.2,3:1.5", penalty_window=16)):  # fmt: skip
        torch.manual_seed(0)
        expected = context.answer(model, tokenizer, QUESTIONS[0], strategy, max_new_tokens=10)
        torch.manual_seed(0)
        answer = loaded.answer(model, tokenizer, QUESTIONS[0], strategy, max_new_tokens=10)
        assert answer.token_ids == expected.token_ids and len(answer.token_ids) == 10
    assert answer.cache_bytes == answer.cache.memory_bytes()


def test_the_full_answer_is_generates_own_and_holds_every_token(fresh):
    model, tokenizer = fresh
    context = Context.compress(model, tokenizer, DOCUMENT, CompressedCache(model, **OPTIONS))
    answer = context.answer(model, tokenizer, QUESTIONS[1], max_new_tokens=12, full=True)
    ids = torch.tensor([context.token_ids + question_ids(tokenizer, QUESTIONS[1], chat=True)])
    with torch.no_grad():
        output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    assert answer.token_ids == output[0, ids.shape[1] :].tolist()
    held = ids.shape[1] + len(answer.token_ids) - 1  # the last token is never fed back
    assert answer.cache_bytes == full_cache_bytes(model, held)
    compressed = context.answer(model, tokenizer, QUESTIONS[1], max_new_tokens=12)
    assert compressed.cache_bytes < answer.cache_bytes / 2


def test_a_replaying_cache_reads_the_document_in_one_pass_then_its_replay_chunks(fresh):
    model, tokenizer = fresh
    cache = CompressedCache(model, **OPTIONS, replay="forward", reconstruction_chunk=128)
    calls = []
    context = Context.compress(model, tokenizer, DOCUMENT, cache, progress=lambda done, total: calls.append(done))
    chunks = 1 + math.ceil(context.seen / 128)  # the prompt's pass, then the replay's chunks
    assert calls == list(range(chunks + 1))


def _assert_keeps_what_chunked_prefill_keeps(model, tokenizer, cache, ids: list[int], options: dict, chunk: int):
    """The oracle: a fresh cache of ``options`` filled by generate's own chunked prefill (``prefill_chunk_size``)
    keeps, in every layer, the positions ``cache`` keeps."""
    oracle = CompressedCache(model, **options)
    batch = torch.tensor([ids])
    with torch.no_grad():
        model.generate(batch, attention_mask=torch.ones_like(batch), past_key_values=oracle, prefill_chunk_size=chunk,
                       max_new_tokens=1, do_sample=False, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    for layer, expected in zip(cache.layers, oracle.layers, strict=True):
        assert torch.equal(layer.kept_positions(), expected.kept_positions())


def test_any_other_cache_reads_the_document_in_chunks_as_transformers_chunked_prefill_does(fresh):
    """Chunk by chunk, each followed by an eviction: the cache never holds more than its size after a chunk, and
    keeps what transformers' own chunked prefill (``prefill_chunk_size``) makes it keep."""
    model, tokenizer = fresh
    ids = document_ids(tokenizer, DOCUMENT)
    cache = CompressedCache(model, budget=48, reconstruction_chunk=128)
    kept = []
    fill(model, cache, torch.tensor([ids]), progress=lambda done, total: kept.append((done, total, cache.kept_tokens)))
    chunks = math.ceil(len(ids) / 128)
    assert [done for done, _, _ in kept] == list(range(chunks + 1)) and {total for _, total, _ in kept} == {chunks}
    assert all(held <= 48 for _, _, held in kept)
    _assert_keeps_what_chunked_prefill_keeps(model, tokenizer, cache, ids, {"budget": 48, "reconstruction_chunk": 128},
                                             128)  # fmt: skip
    assert cache.token_ids == ids


def test_a_replaying_cache_told_a_chunk_reads_the_document_chunk_by_chunk_as_chunked_prefill_does(fresh):
    """Each chunk, then its replay's pieces: progress counts every pass, and the cache keeps what generate's own
    chunked prefill (``prefill_chunk_size``) makes it keep."""
    model, tokenizer = fresh
    ids = document_ids(tokenizer, DOCUMENT)
    options = {**OPTIONS, "replay": "forward", "reconstruction_chunk": 64}
    cache = CompressedCache(model, **options)
    calls = []
    fill(model, cache, torch.tensor([ids]), progress=lambda done, total: calls.append((done, total)), chunk=96)
    pieces = [min(96, len(ids) - start) for start in range(0, len(ids), 96)]
    passes = len(pieces) + sum(math.ceil(piece / 64) for piece in pieces)  # each chunk, then its replay's pieces
    assert calls == [(done, passes) for done in range(passes + 1)]
    _assert_keeps_what_chunked_prefill_keeps(model, tokenizer, cache, ids, options, 96)


def test_bad_requests_are_named(fresh, tmp_path):
    model, tokenizer = fresh
    context = Context.compress(model, tokenizer, DOCUMENT, CompressedCache(model, budget=48))
    with pytest.raises(ValueError, match="drop the strategy's kv_ fields"):
        context.ask(model, tokenizer, QUESTIONS[0], Strategy(kv_budget=64))
    with pytest.raises(ValueError, match="question is empty"):
        context.ask(model, tokenizer, " ")
    with pytest.raises(ValueError, match="max_new_tokens must be"):
        context.ask(model, tokenizer, QUESTIONS[0], max_new_tokens=0)
    with pytest.raises(ValueError, match="cache already holds tokens"):
        fill(model, context.cache, torch.tensor([[5, 6, 7]]))
    bare = CompressedCache(model, budget=48)
    with torch.no_grad():
        model(torch.tensor([context.token_ids]), past_key_values=bare)
    with pytest.raises(ValueError, match="saved without the token ids it holds"):
        Context.load(bare.save(tmp_path / "bare.kv"), model)
    rows = CompressedCache(model, budget=48)
    with torch.no_grad():
        model(torch.tensor([context.token_ids] * 2), past_key_values=rows)
    rows.save(tmp_path / "rows.kv", token_ids=[context.token_ids] * 2)
    with pytest.raises(ValueError, match="holds 2 rows; a context is one document"):
        Context.load(tmp_path / "rows.kv", model)
