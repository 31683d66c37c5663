"""The demo's document tab: a document compressed once per session, then questions answered from forks beside the
full cache's answers, through the API (the library's answers and numbers) and in a real browser."""

from __future__ import annotations

import shutil
from pathlib import Path
from pydoc_data.topics import topics

import pytest

from decodekit.cache import CompressedCache
from decodekit.context import Context
from decodekit.demo.app import DemoLimits, launch, read_upload
from tests.test_demo import _client, _free_port

DOCUMENT = topics["assert"]
QUESTIONS = ["What does assert do?", "When is it skipped?"]
LIMITS = DemoLimits(max_new_tokens=64, max_documents=2)  # (the tiny model reads 1024 positions)


@pytest.fixture(scope="module")
def served(tiny):
    model, tokenizer = tiny
    port = _free_port()
    app = launch(model, tokenizer, port=port, block=False, limits=LIMITS)
    yield f"http://127.0.0.1:{port}/", app, model, tokenizer
    app.close()


def test_questions_in_turn_are_answered_as_the_library_answers_from_a_compressed_document(served):
    url, _, model, tokenizer = served
    client = _client(url)
    numbers = client.predict(document=DOCUMENT, memory_fraction=0.3, api_name="/compress_document")
    expected = Context.compress(model, tokenizer, DOCUMENT,
                                CompressedCache(model, memory_fraction=0.3, scoring="reconstruction"))  # fmt: skip
    assert numbers["tokens seen"] == expected.seen and numbers["tokens kept"] == expected.kept
    assert numbers["compressed cache (KiB)"] == round(expected.memory_bytes() / 1024, 1)
    assert numbers["full 16-bit cache (KiB)"] == round(expected.summary(model)["full_16bit_bytes"] / 1024, 1)
    for question in QUESTIONS:
        result = client.predict(question=question, max_new_tokens=12, api_name="/ask_document")
        compressed = expected.answer(model, tokenizer, question, max_new_tokens=12)
        full = expected.answer(model, tokenizer, question, max_new_tokens=12, full=True)
        assert result["question"] == question
        assert result["compressed"]["text"] == compressed.text and result["full"]["text"] == full.text
        assert result["compressed"]["cache (KiB)"] == round(compressed.cache_bytes / 1024, 1)
        assert result["full"]["cache (KiB)"] == round(full.cache_bytes / 1024, 1)
        assert result["compressed"]["cache (KiB)"] < result["full"]["cache (KiB)"]


def test_each_session_asks_its_own_document_and_the_oldest_is_let_go(served):
    from gradio_client.exceptions import AppError

    url, app, model, tokenizer = served
    first, second, third = _client(url), _client(url), _client(url)
    with pytest.raises(AppError, match="Compress a document first"):
        first.predict(question="Anything?", api_name="/ask_document")
    first.predict(document=topics["pass"], memory_fraction=0.3, api_name="/compress_document")
    second.predict(document=DOCUMENT, memory_fraction=0.3, api_name="/compress_document")
    own = Context.compress(model, tokenizer, topics["pass"],
                           CompressedCache(model, memory_fraction=0.3, scoring="reconstruction"))  # fmt: skip
    answer = first.predict(question=QUESTIONS[0], max_new_tokens=8, api_name="/ask_document")
    assert answer["compressed"]["text"] == own.ask(model, tokenizer, QUESTIONS[0], max_new_tokens=8)
    third.predict(document=DOCUMENT, memory_fraction=0.2, api_name="/compress_document")  # max_documents=2
    assert app.demo_session.documents() == 2
    with pytest.raises(AppError, match="Compress a document first"):
        first.predict(question=QUESTIONS[0], api_name="/ask_document")  # the oldest session's was let go
    assert second.predict(question=QUESTIONS[0], max_new_tokens=4, api_name="/ask_document")["full"]["text"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ({"document": " ", "api_name": "/compress_document"}, "Paste or upload a document first"),
        ({"document": "Hi", "memory_fraction": 0, "api_name": "/compress_document"},
         r"memory fraction must be a number in \(0, 1\]"),
        ({"document": DOCUMENT * 3, "api_name": "/compress_document"}, "The document is too long: .* at most 896"),
        ({"question": "", "api_name": "/ask_document"}, "Type a question first"),
        ({"question": "Why?", "max_new_tokens": 65, "api_name": "/ask_document"},
         r"max new tokens must be a whole number in \[1, 64\]"),
    ],
)  # fmt: skip
def test_bad_requests_show_a_message_and_the_app_keeps_serving(served, call, message):
    from gradio_client.exceptions import AppError

    url, _, _, _ = served
    client = _client(url)
    with pytest.raises(AppError, match=message):
        client.predict(**call)
    assert client.predict(document="A short text.", api_name="/compress_document")["tokens seen"] > 0


def test_an_uploaded_file_is_read_as_utf8_text_or_named(tmp_path):
    import gradio

    good = tmp_path / "doc.txt"
    good.write_text("Café au lait.", encoding="utf-8")
    assert read_upload(str(good)) == "Café au lait." and read_upload(None) == ""
    bad = tmp_path / "doc.bin"
    bad.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(gradio.Error, match="not UTF-8 text"):
        read_upload(str(bad))
    large = tmp_path / "large.txt"
    large.write_bytes(b"a" * ((1 << 20) + 1))
    with pytest.raises(gradio.Error, match="The file is too large"):
        read_upload(str(large))


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = Path(__file__).resolve().parent.parent / "reports"


def test_the_document_tab_compresses_once_and_answers_two_questions_in_a_browser(served, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.fail("Chromium is missing: install Debian's chromium package (.ci/run does)")
    from playwright.sync_api import expect, sync_playwright

    url, _, model, tokenizer = served
    upload = tmp_path / "assert.txt"
    upload.write_text(DOCUMENT, encoding="utf-8")
    expected = Context.compress(model, tokenizer, DOCUMENT,
                                CompressedCache(model, memory_fraction=0.1, scoring="reconstruction"))  # fmt: skip
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        page.goto(url, timeout=120_000)
        page.get_by_role("tab", name="Ask a document").click()
        page.locator("input[type=file][accept='.txt, .md']").set_input_files(str(upload))  # fills the document box
        expect(page.get_by_label("Document", exact=True)).to_have_value(DOCUMENT, timeout=30_000)
        page.get_by_role("button", name="Compress", exact=True).click()
        page.get_by_text("tokens kept").wait_for(timeout=60_000)
        assert page.get_by_text(str(expected.kept), exact=True).count() >= 1
        for number, question in enumerate(QUESTIONS, start=1):
            page.get_by_label("Question", exact=True).fill(question)
            page.get_by_role("button", name="Ask", exact=True).click()
            rows = page.locator("table tbody tr")
            expect(rows).to_have_count(number, timeout=60_000)
            answer = expected.answer(model, tokenizer, question, max_new_tokens=64)
            expect(page.get_by_label("From the compressed document (a fork)")).to_have_value(answer.text)
            full = expected.answer(model, tokenizer, question, max_new_tokens=64, full=True)
            expect(page.get_by_label("From the full cache (the document read again)")).to_have_value(full.text)
        assert page.get_by_text(question, exact=True).count() >= 1  # the history keeps both questions
        assert page.get_by_text(QUESTIONS[0], exact=True).count() >= 1
        SCREENSHOTS.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "demo-document-tab.png"), full_page=True)
        browser.close()
