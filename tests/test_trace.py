"""The step-by-step trace (``generate_with_trace``, ``decodekit generate --trace``).

Oracles: the text generated without a trace; the model's own distribution from a full forward pass
over the prompt and the generated tokens; hand checks of what a processor must do to "after"
(min-p and top-H zero the tokens they remove, greedy selects the likeliest).
"""

from __future__ import annotations

import json

import pytest
import torch

from decodekit import Strategy, generate_text
from decodekit.cli import main
from decodekit.generation import encode_prompts
from decodekit.trace import generate_with_trace

PROMPT = "Hello there"
RECIPES = {
    "greedy": Strategy(),
    "min-p": Strategy(temperature=0.8, min_p=0.1),
    "staged penalty": Strategy(staged_penalty="1:1.2,3:1.5,6:2.0", penalty_window=64),
    "top-h": Strategy(temperature=1.0, top_h=0.4),
    "mirostat": Strategy(temperature=1.0, mirostat_tau=3.0),
    "beam": Strategy(num_beams=3, length_normalization="average"),
    "kv budget": Strategy(kv_budget=36),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_trace_does_not_change_the_text(tiny, name):
    model, tokenizer = tiny
    strategy = RECIPES[name]
    torch.manual_seed(3)
    plain = generate_text(model, tokenizer, [PROMPT], strategy, max_new_tokens=10)[0]
    torch.manual_seed(3)
    trace = generate_with_trace(model, tokenizer, PROMPT, strategy, top=4, max_new_tokens=10)
    assert trace.text == plain
    assert 1 <= len(trace.steps) <= 10 and all(len(step.candidates) == 4 for step in trace.steps)
    chosen = [step.chosen.token_id for step in trace.steps]
    assert tokenizer.decode(chosen, skip_special_tokens=True) == plain


def _model_distribution(model, tokenizer, trace) -> torch.Tensor:
    """The model's next-token probabilities at every generated position, from one full forward pass."""
    prompt = encode_prompts(tokenizer, [PROMPT])["input_ids"]
    generated = torch.tensor([[step.chosen.token_id for step in trace.steps]])
    with torch.inference_mode():
        logits = model(torch.cat([prompt, generated], dim=1)).logits[0, prompt.shape[1] - 1 : -1]
    return torch.softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("name", ["greedy", "min-p", "top-h", "beam"])
def test_before_is_the_models_distribution_and_candidates_are_its_likeliest(tiny, name):
    model, tokenizer = tiny
    trace = generate_with_trace(model, tokenizer, PROMPT, RECIPES[name], top=5, max_new_tokens=8)
    oracle = _model_distribution(model, tokenizer, trace)
    for index, step in enumerate(trace.steps):
        expected = oracle[index].topk(5)
        assert [c.token_id for c in step.candidates] == expected.indices.tolist()
        assert [c.before for c in step.candidates] == pytest.approx(expected.values.tolist(), abs=1e-4)
        assert step.chosen.before == pytest.approx(float(oracle[index, step.chosen.token_id]), abs=1e-4)


def test_greedy_selects_the_likeliest_and_processors_show_in_after(tiny):
    model, tokenizer = tiny
    greedy = generate_with_trace(model, tokenizer, PROMPT, Strategy(), max_new_tokens=6)
    assert all(step.chosen.token_id == step.candidates[0].token_id for step in greedy.steps)
    assert all(step.chosen.after == pytest.approx(step.chosen.before) for step in greedy.steps)
    filtered = generate_with_trace(model, tokenizer, PROMPT, Strategy(temperature=1.0, min_p=0.3), max_new_tokens=6)
    for step in filtered.steps:
        best = step.candidates[0].before
        for candidate in step.candidates:
            if candidate.before < 0.3 * best * 0.999:  # removed by min-p: no probability left
                assert candidate.after == 0.0
            if candidate.before > 0.3 * best * 1.001:  # kept: at least as likely as before, renormalized
                assert candidate.after >= candidate.before * 0.999
        assert step.chosen.after > 0.0


def test_a_beam_trace_applies_the_penalties_to_the_best_hypothesis(tiny):
    model, tokenizer = tiny
    strategy = Strategy(num_beams=3, staged_penalty="1:5.0")
    trace = generate_with_trace(model, tokenizer, PROMPT, strategy, top=5, max_new_tokens=8)
    seen = set(encode_prompts(tokenizer, [PROMPT])["input_ids"][0].tolist())
    penalized = 0
    for step in trace.steps:
        for candidate in step.candidates:
            if candidate.token_id in seen:  # a repeated token loses probability to the penalty
                assert candidate.after < candidate.before
                penalized += 1
        seen.add(step.chosen.token_id)
    assert penalized > 0


def test_the_command_line_prints_and_writes_the_trace(tiny, tiny_model_dir, capsys, tmp_path):
    model, tokenizer = tiny
    expected = generate_text(model, tokenizer, [PROMPT], Strategy(min_p=0.1, temperature=0.7), max_new_tokens=6)[0]
    path = tmp_path / "trace.json"
    code = main(["generate", PROMPT, "--model", str(tiny_model_dir), "--max-new-tokens", "6", "--min-p", "0.1",
                 "--temperature", "0.7", "--seed", "1", "--trace", "3", "--trace-json", str(path)])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    steps = [line for line in out if line.startswith("Step ")]
    assert len(steps) == len(json.loads(path.read_text())["steps"]) >= 1
    assert all(line.count(" -> ") == 4 and "-> selected " in line for line in steps)  # 3 candidates + the choice
    written = json.loads(path.read_text())
    assert written["text"] == "\n".join(out[: out.index(steps[0])])
    assert {"token", "token_id", "before", "after"} == set(written["steps"][0]["chosen"])
    greedy_text = generate_text(model, tokenizer, [PROMPT], Strategy(), max_new_tokens=6)[0]
    code = main(["generate", PROMPT, "--model", str(tiny_model_dir), "--max-new-tokens", "6", "--trace", "2"])
    assert code == 0 and capsys.readouterr().out.startswith(greedy_text)
    assert expected is not None


def test_bad_trace_values_are_refused_by_name(tiny, tiny_model_dir, capsys, tmp_path):
    model, tokenizer = tiny
    with pytest.raises(SystemExit):
        main(["generate", PROMPT, "--model", str(tiny_model_dir), "--trace", "0"])
    assert "--trace" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"top .* must be an integer >= 1"):
        generate_with_trace(model, tokenizer, PROMPT, top=0)
    missing = tmp_path / "no such folder" / "trace.json"
    code = main(["generate", PROMPT, "--model", str(tiny_model_dir), "--max-new-tokens", "2", "--trace-json",
                 str(missing)])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err and "trace.json" in err
