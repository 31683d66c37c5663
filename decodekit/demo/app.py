"""The Gradio app: one prompt, two strategies side by side, streamed with token probabilities.

decodekit demo [--port 7860] [--host 127.0.0.1] [--model ID_OR_DIR]
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr
import pandas as pd

from decodekit.demo.engine import stream
from decodekit.strategies import Strategy

PRESETS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "top-p 0.9, T=0.8": {"temperature": 0.8, "top_p": 0.9},
    "top-k 40, T=0.8": {"temperature": 0.8, "top_k": 40},
    "min-p 0.1, T=1.0": {"temperature": 1.0, "min_p": 0.1},
    "staged penalty": {"staged_penalty": "1:1.2,3:1.5,6:2.0", "penalty_window": 64},
    "beam 4, gnmt": {"num_beams": 4, "length_normalization": "gnmt", "length_alpha": 0.6},
    "greedy, KV budget 64": {"kv_budget": 64},
}
CONTROLS = ("temperature", "top_k", "top_p", "min_p", "staged_penalty", "num_beams", "length_normalization",
            "length_alpha", "kv_budget")  # fmt: skip
MAX_PROMPT_TOKENS = 2048
# System fonts only: the default theme would fetch web fonts from a CDN.
LOCAL_THEME = gr.themes.Default(
    font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"]
)


def strategy_from_controls(preset: str, overrides: dict[str, Any]) -> Strategy:
    """The preset's recipe with every control the user set (0 or empty means unset) on top."""
    if preset not in PRESETS:
        raise gr.Error(f"unknown preset {preset!r}")
    fields = dict(PRESETS[preset])
    for name, value in overrides.items():
        if value not in (None, "", 0):
            fields[name] = int(value) if name in ("top_k", "num_beams", "kv_budget") else value
    if fields.get("num_beams") == 1:
        fields.pop("num_beams")
    if "num_beams" in fields:
        for sampling in ("temperature", "top_k", "top_p", "min_p"):
            fields.pop(sampling, None)
    try:
        return Strategy(name=preset, **fields)
    except (TypeError, ValueError) as error:
        raise gr.Error(str(error)) from None


class DemoSession:
    """The model and a stop switch per browser session."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self._stops: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def stop_event(self, session: str) -> threading.Event:
        with self._lock:
            return self._stops.setdefault(session, threading.Event())

    def run(
        self,
        prompt: str,
        max_new_tokens: int,
        preset: str,
        temperature: float,
        top_k: int,
        top_p: float,
        min_p: float,
        staged_penalty: str,
        num_beams: int,
        length_normalization: str,
        length_alpha: float,
        kv_budget: int,
        request: gr.Request,
    ):
        """Stream one panel: highlighted tokens, stats, and the per-step candidates."""
        values = (temperature, top_k, top_p, min_p, staged_penalty, num_beams, length_normalization, length_alpha,
                  kv_budget)  # fmt: skip
        if not isinstance(prompt, str) or not prompt.strip():
            raise gr.Error("Type a prompt first.")
        if len(self.tokenizer(prompt)["input_ids"]) > MAX_PROMPT_TOKENS:
            raise gr.Error(f"The prompt is too long: at most {MAX_PROMPT_TOKENS} tokens.")
        strategy = strategy_from_controls(preset, dict(zip(CONTROLS, values, strict=True)))
        stop = self.stop_event(request.session_hash if request is not None else "local")
        stop.clear()
        try:
            updates = stream(
                self.model, self.tokenizer, prompt, strategy, max_new_tokens=int(max_new_tokens), stop=stop
            )
            for update in updates:
                if stop.is_set():
                    break
                shaded = update.tokens or [(update.text, None)]
                yield shaded, update.stats, update.candidates, gr.update(maximum=max(2, len(update.candidates)))
        except gr.Error:
            raise
        except (TypeError, ValueError) as error:
            raise gr.Error(str(error)) from None

    def stop(self, request: gr.Request) -> None:
        self.stop_event(request.session_hash if request is not None else "local").set()


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


def _panel(title: str, preset: str) -> dict[str, Any]:
    with gr.Column():
        gr.Markdown(f"### {title}")
        parts: dict[str, Any] = {"preset": gr.Dropdown(list(PRESETS), value=preset, label="Preset")}
        with gr.Accordion("Settings (0 or empty: the preset's)", open=False):
            parts["temperature"] = gr.Number(0, label="temperature")
            parts["top_k"] = gr.Number(0, label="top-k", precision=0)
            parts["top_p"] = gr.Number(0, label="top-p")
            parts["min_p"] = gr.Number(0, label="min-p")
            parts["staged_penalty"] = gr.Textbox("", label="staged penalty, e.g. 1:1.2,3:1.5")
            parts["num_beams"] = gr.Number(0, label="beams", precision=0)
            parts["length_normalization"] = gr.Dropdown(
                ["", "none", "average", "gnmt"], value="", label="normalization"
            )
            parts["length_alpha"] = gr.Number(0, label="length alpha")
            parts["kv_budget"] = gr.Number(0, label="KV budget (tokens)", precision=0)
        parts["output"] = gr.HighlightedText(label="Output (shade: token probability)", combine_adjacent=False)
        parts["stats"] = gr.JSON(label="Stats")
        parts["candidates"] = gr.State([])
        parts["step"] = gr.Slider(1, 2, value=1, step=1, label="Step for the top candidates")
        parts["plot"] = gr.BarPlot(
            x="token", y="probability", color="stage", x_label_angle=-45, label="Top candidates at that step",
            x_title="candidate (a: before, b: after the processors)",
        )  # fmt: skip
    return parts


def build_app(model: Any, tokenizer: Any) -> gr.Blocks:
    """The demo's Blocks, bound to ``model`` and ``tokenizer``."""
    session = DemoSession(model, tokenizer)
    with gr.Blocks(title="decodekit demo", analytics_enabled=False) as app:
        gr.Markdown("# decodekit: decoding strategies side by side")
        prompt = gr.Textbox("Write a short poem about the sea.", label="Prompt", lines=2)
        with gr.Row():
            max_new_tokens = gr.Slider(1, 512, value=64, step=1, label="Max new tokens")
            run = gr.Button("Run", variant="primary")
            stop = gr.Button("Stop")
        with gr.Row():
            panels = [_panel("Strategy A", "greedy"), _panel("Strategy B", "min-p 0.1, T=1.0")]
        events = []
        for index, panel in enumerate(panels):
            inputs = [prompt, max_new_tokens, panel["preset"], *(panel[name] for name in CONTROLS)]
            outputs = [panel["output"], panel["stats"], panel["candidates"], panel["step"]]
            events.append(run.click(session.run, inputs, outputs, api_name=f"run_{'ab'[index]}", concurrency_limit=4))
            for trigger in (panel["step"].change, panel["candidates"].change):
                trigger(candidates_plot, [panel["candidates"], panel["step"]], panel["plot"], api_visibility="private")
        stop.click(session.stop, None, None, cancels=events, api_name="stop")
    return app


def launch(model: Any, tokenizer: Any, *, host: str = "127.0.0.1", port: int = 7860, block: bool = True) -> gr.Blocks:
    """Serve the demo on ``host:port`` (no share link, no analytics)."""
    app = build_app(model, tokenizer).queue(default_concurrency_limit=4)
    app.launch(
        server_name=host, server_port=port, share=False, show_error=False, prevent_thread_lock=not block,
        theme=LOCAL_THEME,
    )  # fmt: skip
    return app


def main(argv: list[str] | None = None) -> int:
    """``python demo/app.py [flags]``: the same as ``decodekit demo [flags]``."""
    from decodekit.cli import main as cli_main

    return cli_main(["demo", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    raise SystemExit(main())
