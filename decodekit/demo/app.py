"""The Gradio app: one prompt, two strategies side by side, streamed with token probabilities; and a document
compressed once and asked several questions, each from a fork, beside the full cache's answers.

Started by ``decodekit demo [--port 7860] [--host 127.0.0.1] [--auth-file FILE] [--model ID_OR_DIR]``.
Programs call it by name through ``gradio_client``: ``/generate`` (prompt, max_new_tokens, preset,
settings), ``/stop``, ``/compress_document`` (document, memory_fraction) and ``/ask_document`` (question,
max_new_tokens).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr
import pandas as pd

from decodekit._validation import as_integer, as_real, check_int
from decodekit.cache import _native
from decodekit.demo.access import is_loopback
from decodekit.demo.engine import Stats, Update, stream
from decodekit.fields import BY_NAME, FIELDS, SAMPLING_FIELDS
from decodekit.strategies import Strategy

logger = logging.getLogger("decodekit.demo")

PRESETS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "top-p 0.9, T=0.8": {"temperature": 0.8, "top_p": 0.9},
    "top-k 40, T=0.8": {"temperature": 0.8, "top_k": 40},
    "min-p 0.1, T=1.0": {"temperature": 1.0, "min_p": 0.1},
    "staged penalty": {"staged_penalty": "1:1.2,3:1.5,6:2.0", "penalty_window": 64},
    "beam 4, gnmt": {"num_beams": 4, "length_normalization": "gnmt", "length_alpha": 0.6},
    "greedy, KV budget 64": {"kv_budget": 64},
}
CONTROLS = tuple(field.name for field in FIELDS if field.widget)  # the table's fields with a demo widget
INTEGER_CONTROLS = tuple(name for name in CONTROLS if BY_NAME[name].kind == "integer")
MAX_PROMPT_TOKENS = 2048
MAX_UPLOAD_BYTES = 1 << 20  # a document file read into the page
QUESTION_ROOM = 64  # tokens a document leaves for a question within the model's positions


@dataclass(frozen=True)
class DemoLimits:
    """What one server takes on at once, so that a small machine is not oversubscribed.

    Attributes:
        max_concurrent: generations running at once, across every visitor (two per side-by-side
            run); the others wait in the queue, which shows each its position and expected wait.
        max_queue: requests waiting at most; past it a visitor is told the queue is full.
        max_beams: the largest beam count the page accepts (memory grows with it).
        max_new_tokens: the most tokens one run may generate.
        max_document_tokens: the longest document the document tab compresses (and at most the model's positions
            less room for a question and its answer).
        max_documents: compressed documents held at once, one per visitor's session; the oldest is let go first.
    """

    max_concurrent: int = 2
    max_queue: int = 64
    max_beams: int = 8
    max_new_tokens: int = 512
    max_document_tokens: int = 4096
    max_documents: int = 8

    def __post_init__(self) -> None:
        for name in ("max_concurrent", "max_queue", "max_beams", "max_new_tokens", "max_document_tokens",
                     "max_documents"):  # fmt: skip
            check_int(name, getattr(self, name), 1)


def _user_error(message: str) -> gr.Error:
    """A message for the page; the server's log gets one line, not a traceback."""
    logger.info("request refused: %s", message)
    return gr.Error(message, print_exception=False)


def whole_number(label: str, value: Any, low: int, high: int) -> int:
    """A control's value as an int in [low, high], or a page error naming the control."""
    number = as_integer(value)
    real = as_real(value)
    if number is None and real is not None and real.is_integer():
        number = int(real)
    if number is None or not low <= number <= high:
        raise _user_error(f"{label} must be a whole number in [{low}, {high}]; got {value!r}")
    return number


# System fonts only: the default theme would fetch web fonts from a CDN.
LOCAL_THEME = gr.themes.Default(
    font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"]
)


def strategy_from_controls(preset: str, overrides: dict[str, Any], *, max_beams: int = 8) -> Strategy:
    """The preset's recipe with every control the user set (0 or empty means unset) on top."""
    if preset not in PRESETS:
        raise _user_error(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    fields = dict(PRESETS[preset])
    for name, value in overrides.items():
        if value in (None, "", 0):
            continue
        if name in INTEGER_CONTROLS:
            high = max_beams if name == "num_beams" else 1 << 31
            value = whole_number(name.replace("_", " "), value, 1, high)
        elif BY_NAME[name].kind == "choice" and isinstance(value, str):  # a dropdown's text, e.g. "8" for kv_bits
            try:
                value = BY_NAME[name].parse(value)
            except ValueError as error:
                raise _user_error(f"{name} {error}") from None
        fields[name] = value
    if fields.get("num_beams") == 1:
        fields.pop("num_beams")
    if "num_beams" in fields:
        for sampling in SAMPLING_FIELDS:
            fields.pop(sampling, None)
    try:
        return Strategy(name=preset, **fields)
    except (TypeError, ValueError) as error:
        raise _user_error(str(error)) from None


class DemoSession:
    """The model, the limits, and the stop switches of the runs in progress per browser session.

    A run is registered under its visitor's Gradio session (a browser tab, or one ``gradio_client.Client``),
    so that Stop ends that visitor's runs and no one else's.
    """

    def __init__(self, model: Any, tokenizer: Any, limits: DemoLimits | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.limits = limits or DemoLimits()
        self._runs: dict[str, set[threading.Event]] = {}
        self._lock = threading.Lock()
        self._documents: OrderedDict[str, Any] = OrderedDict()  # session -> its compressed document (a Context)

    def _begin(self, session: str) -> threading.Event:
        stop = threading.Event()
        with self._lock:
            self._runs.setdefault(session, set()).add(stop)
        return stop

    def _end(self, session: str, stop: threading.Event) -> None:
        stop.set()
        with self._lock:
            runs = self._runs.get(session, set())
            runs.discard(stop)
            if not runs:
                self._runs.pop(session, None)

    def running(self) -> int:
        """How many runs are in progress."""
        with self._lock:
            return sum(len(runs) for runs in self._runs.values())

    def sessions(self) -> dict[str, int]:
        """The sessions with runs in progress, and how many each has."""
        with self._lock:
            return {session: len(runs) for session, runs in self._runs.items()}

    def updates(
        self, prompt: str, max_new_tokens: Any, preset: str, settings: Mapping[str, Any] | None, session: str
    ) -> Iterator[tuple[Update, Strategy]]:
        """Check a request, then stream its generation, registered under ``session`` until it ends.

        ``settings`` maps field names (``decodekit.fields``) to values; a missing name, None, 0 or an
        empty string leaves the field to the preset. The generation stops within a step when the
        session's Stop fires or the consumer closes this generator.
        """
        if not isinstance(prompt, str) or not prompt.strip():
            raise _user_error("Type a prompt first.")
        if len(self.tokenizer(prompt)["input_ids"]) > MAX_PROMPT_TOKENS:
            raise _user_error(f"The prompt is too long: at most {MAX_PROMPT_TOKENS} tokens.")
        max_new_tokens = whole_number("max new tokens", max_new_tokens, 1, self.limits.max_new_tokens)
        strategy = strategy_from_controls(preset, check_settings(settings), max_beams=self.limits.max_beams)
        stop = self._begin(session)
        updates = None
        try:
            updates = stream(self.model, self.tokenizer, prompt, strategy, max_new_tokens=max_new_tokens, stop=stop)
            for update in updates:
                if stop.is_set() and not update.done:
                    continue  # stopped: only the final update (what was generated) is still worth showing
                yield update, strategy
        except (TypeError, ValueError) as error:
            raise _user_error(str(error)) from None
        finally:
            if updates is not None:
                updates.close()  # stops the generation thread if it is still running
            self._end(session, stop)

    def run_panel(self, names: Mapping[Any, str], values: Mapping[Any, Any], session: str):
        """Stream one panel of the page: highlighted tokens, stats, and the per-step candidates.

        ``values`` maps the panel's components to their values and ``names`` those components to
        ``prompt``, ``max_new_tokens``, ``preset`` or a field name.
        """
        named = {names[component]: value for component, value in values.items()}
        prompt, max_new_tokens, preset = (named.pop(key) for key in ("prompt", "max_new_tokens", "preset"))
        for update, strategy in self.updates(prompt, max_new_tokens, preset, named, session):
            shaded = update.tokens or [(update.text, None)]
            stats = format_stats(update.stats, beam=strategy.beam)
            yield shaded, stats, update.candidates, gr.update(maximum=max(2, len(update.candidates)))

    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        preset: str = "greedy",
        settings: dict[str, Any] | None = None,
        request: gr.Request = None,
    ) -> Iterator[dict[str, Any]]:
        """Generate from ``prompt`` with a preset and named settings, streaming the result so far.

        ``settings`` maps decoding field names (``temperature``, ``min_p``, ``num_beams``, ...) to
        values on top of the preset. Each update is ``{"text", "tokens": [[token, probability], ...],
        "stats", "done"}``; the last one has ``done`` true.
        """
        for update, strategy in self.updates(prompt, max_new_tokens, preset, settings, _session_of(request)):
            yield {
                "text": update.text,
                "tokens": [[text, probability] for text, probability in update.tokens],
                "stats": format_stats(update.stats, beam=strategy.beam),
                "done": update.done,
            }

    # -- the document tab ---------------------------------------------------------------------------------------

    def document_token_limit(self) -> int:
        """The longest document compressed: ``max_document_tokens``, within the model's positions less room for a
        question (``QUESTION_ROOM`` tokens) and the longest answer."""
        limit = self.limits.max_document_tokens
        positions = self._positions()
        if positions is not None:
            limit = min(limit, positions - self.limits.max_new_tokens - QUESTION_ROOM)
        return max(limit, 1)

    def _positions(self) -> int | None:
        positions = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        return positions if isinstance(positions, int) else None

    def compress_document(self, document: str, memory_fraction: float = 0.1, request: gr.Request = None) -> dict:
        """Compress ``document`` for the calling session (replacing its previous one) to ``memory_fraction`` of a
        full 16-bit cache's bytes, with reconstruction scores (the questions are not known yet). Returns its
        numbers: ``{"tokens seen", "tokens kept", "compressed cache (KiB)", "full 16-bit cache (KiB)", "seconds"}``.

        Example (a running demo, from ``gradio_client``)::

            client = Client("http://127.0.0.1:7860/")
            print(client.predict(document=open("report.txt").read(), memory_fraction=0.1,
                                 api_name="/compress_document"))
        """
        from decodekit.cache import CompressedCache
        from decodekit.context import Context, document_ids
        from decodekit.generation import uses_chat_template

        if not isinstance(document, str) or not document.strip():
            raise _user_error("Paste or upload a document first.")
        fraction = as_real(memory_fraction)
        if fraction is None or not 0 < fraction <= 1:
            raise _user_error(f"memory fraction must be a number in (0, 1]; got {memory_fraction!r}")
        ids = document_ids(self.tokenizer, document)
        limit = self.document_token_limit()
        if len(ids) > limit:
            raise _user_error(f"The document is too long: {len(ids)} tokens; at most {limit}.")
        started = time.perf_counter()
        try:
            cache = CompressedCache(self.model, memory_fraction=fraction, scoring="reconstruction")
            context = Context.from_ids(self.model, ids, cache, chat=uses_chat_template(self.tokenizer, None))
        except (TypeError, ValueError) as error:
            raise _user_error(str(error)) from None
        seconds = time.perf_counter() - started
        session = _session_of(request)
        with self._lock:
            self._documents.pop(session, None)
            self._documents[session] = context
            while len(self._documents) > self.limits.max_documents:
                self._documents.popitem(last=False)
        numbers = context.summary(self.model)
        return {
            "tokens seen": numbers["tokens_seen"], "tokens kept": numbers["tokens_kept"],
            "compressed cache (KiB)": _kib(numbers["memory_bytes"]),
            "full 16-bit cache (KiB)": _kib(numbers["full_16bit_bytes"]),
            "seconds": round(seconds, 3),
        }  # fmt: skip

    def ask_document(self, question: str, max_new_tokens: int = 64, request: gr.Request = None) -> dict:
        """Answer ``question`` about the calling session's compressed document from a fork of it (the document
        stays as it was for the next question), and from the full cache that reads the document again. Returns
        ``{"question", "compressed": {"text", "cache (KiB)", "seconds"}, "full": {...}}``: each answer with the
        bytes its cache holds after it.

        Example (the same ``client`` after ``/compress_document``)::

            result = client.predict(question="Who signed it?", max_new_tokens=48, api_name="/ask_document")
            print(result["compressed"]["text"], "|", result["full"]["text"])
        """
        if not isinstance(question, str) or not question.strip():
            raise _user_error("Type a question first.")
        max_new_tokens = whole_number("max new tokens", max_new_tokens, 1, self.limits.max_new_tokens)
        with self._lock:
            context = self._documents.get(_session_of(request))
        if context is None:
            raise _user_error("Compress a document first.")
        positions = self._positions()
        asked = len(context.question_ids(self.tokenizer, question))
        if positions is not None and context.seen + asked + max_new_tokens > positions:
            room = positions - context.seen - max_new_tokens
            raise _user_error(f"The question is too long: {asked} tokens; at most {max(room, 0)} with this document "
                              f"and {max_new_tokens} answer tokens.")  # fmt: skip
        answers = {}
        try:
            for name, full in (("compressed", False), ("full", True)):
                answer = context.answer(self.model, self.tokenizer, question, max_new_tokens=max_new_tokens,
                                        full=full)  # fmt: skip
                answers[name] = {"text": answer.text, "cache (KiB)": _kib(answer.cache_bytes),
                                 "seconds": round(answer.seconds, 3)}  # fmt: skip
        except (TypeError, ValueError) as error:
            raise _user_error(str(error)) from None
        return {"question": question, **answers}

    def documents(self) -> int:
        """How many compressed documents are held (one per session at most)."""
        with self._lock:
            return len(self._documents)

    def stop(self, request: gr.Request = None) -> int:
        """Stop every run of this visitor's session; return how many were running."""
        with self._lock:
            runs = list(self._runs.get(_session_of(request), ()))
        for event in runs:
            event.set()
        return len(runs)


def _session_of(request: gr.Request | None) -> str:
    """The visitor's Gradio session; "local" for a call from Python without one."""
    return request.session_hash if request is not None and request.session_hash else "local"


def _kib(count: int) -> float:
    return round(count / 1024, 1)


def read_upload(path: str | None) -> str:
    """The text of an uploaded document file (UTF-8, at most ``MAX_UPLOAD_BYTES``), or a page error saying why
    not; "" when nothing was uploaded.

    Example:
        >>> read_upload(None)
        ''
    """
    if not path:
        return ""
    size = os.path.getsize(path)
    if size > MAX_UPLOAD_BYTES:
        raise _user_error(f"The file is too large: {size:,} bytes; at most {MAX_UPLOAD_BYTES:,}.")
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except UnicodeDecodeError:
        raise _user_error("The file is not UTF-8 text: upload a plain text file.") from None


HISTORY_COLUMNS = ["question", "compressed answer", "compressed cache (KiB)", "full answer", "full cache (KiB)"]


def check_settings(settings: Any) -> dict[str, Any]:
    """``settings`` as a dict of known field names (None: no settings), or a page error naming the bad key."""
    if settings is None:
        return {}
    if not isinstance(settings, Mapping):
        raise _user_error(f"settings must map field names to values, like {{'temperature': 0.8}}; got {settings!r}")
    unknown = sorted(str(name) for name in settings if name not in CONTROLS)
    if unknown:
        raise _user_error(f"unknown setting {unknown[0]!r}; the settings are: {', '.join(CONTROLS)}")
    return dict(settings)


def candidates_plot(candidates: list[dict[str, Any]], step: int) -> pd.DataFrame:
    """The top tokens at ``step`` (1-based), before and after the processors, as bar plot rows."""
    if not candidates:
        return pd.DataFrame({"token": [], "probability": [], "stage": []})
    entry = candidates[min(max(int(step), 1), len(candidates)) - 1]
    rows = []
    for rank, token in enumerate(entry["tokens"]):  # one bar per token and stage, side by side
        rows.append((f"{rank + 1}a {token!r}", entry["before"][rank], "before processors"))
        rows.append((f"{rank + 1}b {token!r}", entry["after"][rank], "after processors"))
    return pd.DataFrame(rows, columns=["token", "probability", "stage"])


def format_stats(stats: Stats, *, beam: bool = False) -> dict[str, Any]:
    """The page's stats panel: labelled, rounded, in KiB and seconds; absent numbers left out."""
    shown: dict[str, Any] = {"new tokens": stats.new_tokens}
    if beam:
        shown["beam steps"] = stats.steps
    if stats.first_token_seconds is not None:
        shown["time to first token (s)"] = round(stats.first_token_seconds, 3)
    if stats.tokens_per_second is not None:
        shown["steps/s" if beam else "tokens/s"] = round(stats.tokens_per_second, 2)
    shown["full KV cache (KiB)"] = round(stats.full_cache_bytes / 1024, 1)
    if stats.compressed_cache_bytes is not None:
        shown["compressed KV cache (KiB)"] = round(stats.compressed_cache_bytes / 1024, 1)
    if stats.best_score is not None:
        shown["best score"] = round(stats.best_score, 4)
    if stats.total_seconds is not None:
        shown["total time (s)"] = round(stats.total_seconds, 3)
    return shown


def _control(field: Any) -> Any:
    """The demo widget of a table field, labelled with its help and range."""
    label = f"{field.name.replace('_', ' ')}: {field.help}" + (f", {field.span}" if field.span else "")
    if field.widget == "choice":
        return gr.Dropdown(["", *map(str, field.choices)], value="", label=label)
    if field.widget == "text":
        return gr.Textbox("", label=label)
    return gr.Number(
        0, label=label, precision=0 if field.kind == "integer" else None, minimum=0 if field.kind == "integer" else None
    )


def _panel(title: str, preset: str) -> dict[str, Any]:
    with gr.Column():
        gr.Markdown(f"### {title}")
        parts: dict[str, Any] = {"preset": gr.Dropdown(list(PRESETS), value=preset, label="Preset")}
        with gr.Accordion("Settings (0 or empty: the preset's)", open=False):
            for name in CONTROLS:
                parts[name] = _control(BY_NAME[name])
        parts["output"] = gr.HighlightedText(label="Output (shade: token probability)", combine_adjacent=False)
        parts["stats"] = gr.JSON(label="Stats")
        parts["candidates"] = gr.State([])
        parts["step"] = gr.Slider(1, 2, value=1, step=1, label="Step for the top candidates")
        parts["plot"] = gr.BarPlot(
            x="token", y="probability", color="stage", x_label_angle=-45, label="Top candidates at that step",
            x_title="candidate (a: before, b: after the processors)",
        )  # fmt: skip
    return parts


def _document_tab(session: DemoSession) -> None:
    """The document tab: a document compressed once, then questions in turn, each answered from a fork of it beside
    the full cache's answer, with the bytes each cache holds."""
    limits = session.limits
    gr.Markdown(
        "Compress a document once, then ask it several questions. Each answer comes from a fork of the compressed "
        "document (which stays as it was for the next question); beside it, the answer of the full cache, which "
        "reads the whole document again for every question."
    )
    document = gr.Textbox(label="Document", lines=10, placeholder="Paste a text here, or upload a file below.")
    upload = gr.File(label="Upload a text file", file_types=[".txt", ".md"], type="filepath")
    with gr.Row():
        fraction = gr.Slider(0.02, 0.5, value=0.1, step=0.01, label="Memory kept (a fraction of a full 16-bit cache)")
        compress = gr.Button("Compress", variant="primary")
    numbers = gr.JSON(label="Compressed document")
    question = gr.Textbox(label="Question", lines=1, placeholder="Ask about the document.")
    with gr.Row():
        answer_tokens = gr.Slider(1, limits.max_new_tokens, value=64, step=1, label="Answer tokens at most")
        ask = gr.Button("Ask", variant="primary")
    with gr.Row():
        compressed = gr.Textbox(label="From the compressed document (a fork)", lines=4)
        full = gr.Textbox(label="From the full cache (the document read again)", lines=4)
    history = gr.Dataframe(
        headers=HISTORY_COLUMNS, value=[], label="Questions so far", wrap=True, interactive=False,
        column_widths=["16%", "32%", "9%", "34%", "9%"],
    )  # fmt: skip

    def on_compress(text: str, memory_fraction: float, request: gr.Request):
        return session.compress_document(text, memory_fraction, request), [], "", ""

    def on_ask(text: str, tokens: float, asked: Any, request: gr.Request):
        result = session.ask_document(text, tokens, request)
        rows = asked.values.tolist() if isinstance(asked, pd.DataFrame) else list(asked or [])
        rows.append([result["question"], result["compressed"]["text"], result["compressed"]["cache (KiB)"],
                     result["full"]["text"], result["full"]["cache (KiB)"]])  # fmt: skip
        return result["compressed"]["text"], result["full"]["text"], pd.DataFrame(rows, columns=HISTORY_COLUMNS)

    upload.upload(read_upload, upload, document, api_visibility="private")
    shared = {"concurrency_id": "generate", "concurrency_limit": limits.max_concurrent, "api_visibility": "private"}
    compress.click(on_compress, [document, fraction], [numbers, history, compressed, full],
                   api_name="compress_page", **shared)  # fmt: skip
    ask.click(on_ask, [question, answer_tokens, history], [compressed, full, history], api_name="ask_page",
              **shared)  # fmt: skip


def build_app(model: Any, tokenizer: Any, limits: DemoLimits | None = None) -> gr.Blocks:
    """The demo's Blocks, bound to ``model`` and ``tokenizer``: a tab of strategies side by side, a tab of a
    document asked several questions."""
    limits = limits or DemoLimits()
    session = DemoSession(model, tokenizer, limits)
    with gr.Blocks(title="decodekit demo", analytics_enabled=False) as app:
        gr.Markdown("# decodekit demo")
        with gr.Tab("Strategies side by side"):
            _strategies_tab(session)
        with gr.Tab("Ask a document"):
            _document_tab(session)
        # The API: parameters by name, so that a client keeps working when a field is added.
        gr.api(
            session.generate, api_name="generate", concurrency_id="generate", concurrency_limit=limits.max_concurrent
        )
        gr.api(session.stop, api_name="stop")
        for function in (session.compress_document, session.ask_document):
            gr.api(function, api_name=function.__name__, concurrency_id="generate",
                   concurrency_limit=limits.max_concurrent)  # fmt: skip
    app.demo_session = session  # for tests and load checks: runs in progress
    return app


def _strategies_tab(session: DemoSession) -> None:
    """The first tab: one prompt, two strategies side by side."""
    limits = session.limits
    prompt = gr.Textbox("Write a short poem about the sea.", label="Prompt", lines=2)
    with gr.Row():
        max_new_tokens = gr.Slider(1, limits.max_new_tokens, value=64, step=1, label="Max new tokens")
        run = gr.Button("Run", variant="primary")
        stop = gr.Button("Stop")
    with gr.Row():
        panels = [_panel("Strategy A", "greedy"), _panel("Strategy B", "min-p 0.1, T=1.0")]
    events = []
    for index, panel in enumerate(panels):
        names = {prompt: "prompt", max_new_tokens: "max_new_tokens", panel["preset"]: "preset"}
        names.update({panel[name]: name for name in CONTROLS})
        outputs = [panel["output"], panel["stats"], panel["candidates"], panel["step"]]

        def run_panel(values: dict, request: gr.Request, names: dict = names):
            yield from session.run_panel(names, values, _session_of(request))

        # The page's own event: its inputs arrive by component, so the handler takes them by name.
        # Both panels share one limit, so at most max_concurrent generations run at once.
        event = run.click(
            run_panel, set(names), outputs, api_name=f"run_{'ab'[index]}", api_visibility="private",
            concurrency_id="generate", concurrency_limit=limits.max_concurrent,
        )  # fmt: skip
        events.append(event)
        for trigger in (panel["step"].change, panel["candidates"].change):
            trigger(candidates_plot, [panel["candidates"], panel["step"]], panel["plot"], api_visibility="private")
    stop.click(session.stop, None, None, cancels=events, api_name="stop_page", api_visibility="private")


def start_message(host: str, port: int, accounts: int) -> str:
    """The one line the demo prints when it starts: where it serves, and who may use it.

    Example:
        >>> start_message("0.0.0.0", 7860, 0).split(", ")[1]
        'open to anyone who can reach this port (no --auth-file) (Ctrl-C stops it)'
    """
    if accounts:
        access = f", sign-in required ({accounts} account{'s' if accounts > 1 else ''})"
    elif is_loopback(host):
        access = ""
    else:
        access = ", open to anyone who can reach this port (no --auth-file)"
    return f"decodekit demo: serving on http://{host}:{port}{access} (Ctrl-C stops it)"


def launch(
    model: Any,
    tokenizer: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 7860,
    block: bool = True,
    limits: DemoLimits | None = None,
    auth: Sequence[tuple[str, str]] | None = None,
) -> gr.Blocks:
    """Serve the demo on ``host:port`` (no share link, no analytics).

    ``auth``: the ``(user, password)`` accounts that may sign in (see ``access.read_auth_file``); None
    lets anyone who reaches the port in, which the start message says when ``host`` is not loopback.
    """
    limits = limits or DemoLimits()
    if str(getattr(model, "device", "cpu")).startswith("cpu"):  # the cache's CPU operators, built once, meanwhile
        threading.Thread(target=_native.available, name="decodekit-cpu-operators", daemon=True).start()
    app = build_app(model, tokenizer, limits).queue(max_size=limits.max_queue)
    # quiet: Gradio's banner suggests share=True, which the command line does not offer; say where instead.
    app.launch(
        server_name=host, server_port=port, share=False, show_error=False, prevent_thread_lock=True,
        theme=LOCAL_THEME, quiet=True, auth=list(auth) if auth else None,
    )  # fmt: skip
    print(start_message(host, port, len(auth or ())), flush=True)
    if block:
        app.block_thread()
    return app
