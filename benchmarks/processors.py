"""Per-call time of decodekit's processors against transformers' built-ins, and their end-to-end cost.

    python benchmarks/processors.py [--rounds 15] [--generate-rounds 5] [--device cpu|cuda]

Prints ratios measured side by side in one run, and each candidate's page faults per call. The
script first asks glibc to keep freed memory for reuse, as a long-running process does: left to
its own threshold, it hands large temporaries back to the system in some runs and not in others,
and a candidate that then pays fresh pages on every call looks up to twice as slow.

Ratios:
  1. min-p vs MinPLogitsWarper on scores [32, 49152]            (target: ours >= 5x faster)
  2. staged penalty (512-token window) vs RepetitionPenalty      (target: ours <= 2x its time)
  3. DRY, XTC, top-n-sigma, Mirostat, p-less and min-k against naive per-row references written from
     their definitions (the same results, checked before timing) (no target: how far vectorizing goes)
     min-k against min-p on the same scores                    (target: min-k <= 2x min-p's time),
     and against its own full sort (the path other devices take)
     Top-H, typical, epsilon and eta against transformers' warpers, one value for the batch, and
     per-row values against a loop of warpers (the same tokens kept, checked before timing)
  4. the seeded sampling noise (32-bit uniforms, finite everywhere) against the earlier 24-bit
     construction it replaced, on the same hash                 (target: at most a few percent slower)
  4. generate on the default model, batch 8, 64 new tokens, sampling with and without each
     recipe's processors: min-p + staged + frequency/presence; DRY + top-n-sigma + XTC; Mirostat
                                                                 (target: each <= 3% slower)
"""

from __future__ import annotations

import argparse
import math

import torch
from _timing import (  # benchmarks/ is on sys.path when a script in it runs
    interleaved_medians,
    keep_freed_memory,
    page_faults_per_call,
    verdict,
)
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.logits_process import TopHLogitsWarper

from decodekit import (
    DRYLogitsProcessor,
    EpsilonLogitsProcessor,
    EtaLogitsProcessor,
    FrequencyPresencePenaltyLogitsProcessor,
    MinKLogitsProcessor,
    MinPLogitsProcessor,
    MirostatLogitsProcessor,
    PLessLogitsProcessor,
    StagedRepetitionPenaltyLogitsProcessor,
    TopHLogitsProcessor,
    TopNSigmaLogitsProcessor,
    TypicalLogitsProcessor,
    XTCLogitsProcessor,
    encode_prompts,
    load_model,
)
from decodekit.logits_processors.dry import breaker_token_ids
from decodekit.logits_processors.min_k import sorted_threshold
from decodekit.logits_processors.seeded import MASK32, MULTIPLIERS, _mix, gumbel_noise, uniform_draws

BATCH, VOCAB, WINDOW = 32, 49152, 512
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List some ideas for a rainy afternoon.",
    "Describe the water cycle.",
    "What makes a good cup of tea?",
    "Give advice to a new programmer.",
    "Describe a busy market in the morning.",
    "Why do leaves change color in autumn?",
]


def per_call(rounds: int, allocator_pinned: bool, device: str) -> None:
    generator = torch.Generator().manual_seed(0)
    scores = (torch.randn(BATCH, VOCAB, generator=generator) * 4).to(device)
    input_ids = torch.randint(0, VOCAB, (BATCH, WINDOW), generator=generator).to(device)
    ours_min_p, theirs_min_p = MinPLogitsProcessor(0.1), MinPLogitsWarper(0.1)
    assert torch.equal(ours_min_p(input_ids, scores), theirs_min_p(input_ids, scores))
    staged = StagedRepetitionPenaltyLogitsProcessor({1: 1.2, 3: 1.5, 6: 2.0}, window=WINDOW)
    repetition = RepetitionPenaltyLogitsProcessor(1.2)
    candidates = {
        "min-p (decodekit)": lambda: ours_min_p(input_ids, scores),
        "MinPLogitsWarper": lambda: theirs_min_p(input_ids, scores),
        "staged penalty (decodekit)": lambda: staged(input_ids, scores),
        "RepetitionPenaltyLogitsProcessor": lambda: repetition(input_ids, scores),
    }
    times = interleaved_medians(candidates, rounds=rounds, calls=20, warmup=5)
    faults = {name: page_faults_per_call(function) for name, function in candidates.items()}
    print(f"Per call on scores [{BATCH}, {VOCAB}], {torch.get_num_threads()} threads, median of {rounds} rounds:")
    print(f"  (allocator keeps freed memory: {allocator_pinned}; page faults are counted over 10 more calls)")
    for name, seconds in times.items():
        fault_note = "" if faults[name] is None else f"   {faults[name]:6.0f} page faults/call"
        print(f"  {name:<34} {seconds * 1e3:8.3f} ms{fault_note}")
    speedup = times["MinPLogitsWarper"] / times["min-p (decodekit)"]
    print(f"  min-p speedup over MinPLogitsWarper: {speedup:.2f}x  (target >= 5x: {verdict(speedup >= 5)})")
    ratio = times["staged penalty (decodekit)"] / times["RepetitionPenaltyLogitsProcessor"]
    print(f"  staged penalty / RepetitionPenalty:  {ratio:.2f}x  (target <= 2x: {verdict(ratio <= 2)})")


def naive_dry(input_ids, scores, breakers, multiplier=0.8, base=1.75, allowed=2, last_n=WINDOW):
    """text-generation-webui's loop, row by row."""
    out = scores.clone()
    for row, ids in enumerate(input_ids[:, -last_n:].tolist()):
        last, lengths = ids[-1], {}
        if last in breakers:
            continue
        for index in (i for i, token in enumerate(ids[:-1]) if token == last):
            following, length = ids[index + 1], 1
            if following in breakers:
                continue
            while length < 50 and index - length >= 0:
                previous = ids[-(length + 1)]
                if ids[index - length] != previous or previous in breakers:
                    break
                length += 1
            lengths[following] = max(length, lengths.get(following, 0))
        for token, length in lengths.items():
            if length >= allowed:
                out[row, token] -= multiplier * base ** (length - allowed)
    return out


def naive_xtc(scores, threshold, probability, seeds, step):
    draws = uniform_draws(seeds, step, scores.device, 2)
    out = scores.clone()
    for row in range(scores.shape[0]):
        if draws[row] >= probability:
            continue
        probabilities = torch.softmax(scores[row].float(), dim=-1)
        tops = (probabilities >= threshold).nonzero().flatten()
        if len(tops) >= 2:
            least = probabilities[tops].min()
            out[row, tops[probabilities[tops] > least]] = float("-inf")
    return out


def naive_top_n_sigma(scores, n):
    out = scores.clone()
    for row in range(scores.shape[0]):
        threshold = scores[row].max() - n * scores[row].std()
        out[row, scores[row] < threshold] = float("-inf")
    return out


def naive_mirostat(scores, tau):
    """The first step of Mirostat 2 (mu = 2 tau), llama.cpp style: sort, then cut by surprise."""
    out = torch.full_like(scores, float("-inf"))
    for row in range(scores.shape[0]):
        probabilities, order = torch.softmax(scores[row], dim=-1).sort(descending=True)
        keep = max(1, int((-torch.log2(probabilities) <= 2 * tau).sum()))
        out[row, order[:keep]] = scores[row, order[:keep]]
    return out


def naive_p_less(scores, order):
    """p-less row by row from the paper: keep p >= (sum p^q)^(1/(q-1))."""
    out = scores.clone()
    for row in range(scores.shape[0]):
        probabilities = torch.softmax(scores[row].float(), dim=-1)
        threshold = probabilities.pow(order).sum().pow(1.0 / (order - 1.0))
        out[row][probabilities < threshold * (1 - 1e-5)] = -math.inf
    return out


def naive_min_k(scores, exponent):
    """min-k row by row from its description: sort, drop / (range * rank^exponent), cut at the first best."""
    out = scores.clone()
    for row in range(scores.shape[0]):
        ordered = scores[row].sort(descending=True).values
        drops = (ordered[:-1] - ordered[1:]) / (ordered[0] - ordered[-1])
        ranks = torch.arange(1, len(ordered), device=scores.device, dtype=torch.float64)
        cut = int((drops.double() / ranks**exponent).argmax())
        out[row][scores[row] < ordered[cut]] = -math.inf
    return out


def min_k_per_call(rounds: int, device: str) -> None:
    """min-k against min-p (the target), its own full-sort path, and the naive loop, on the same scores."""
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randn(BATCH, VOCAB, generator=generator) * 4).to(device) for _ in range(8)]
    min_k, min_p = MinKLogitsProcessor(1.0), MinPLogitsProcessor(0.1)
    weights = min_k.weights(BATCH, VOCAB, batches[0].device)

    def sorted_path(scores):
        threshold = sorted_threshold(scores, weights)
        return scores.masked_fill(scores < threshold, -math.inf)

    for scores in batches:
        ours = min_k(None, scores)
        assert torch.equal(ours.isfinite(), naive_min_k(scores, 1.0).isfinite()), "min-k differs from its reference"
        assert torch.equal(ours.isfinite(), sorted_path(scores).isfinite()), "min-k differs from its full sort"
    candidates = {
        "min-k (decodekit)": lambda: [min_k(None, scores) for scores in batches],
        "min-p (decodekit)": lambda: [min_p(None, scores) for scores in batches],
        "min-k, full sort": lambda: [sorted_path(scores) for scores in batches],
        "min-k, naive loop": lambda: [naive_min_k(scores, 1.0) for scores in batches],
    }
    # Other exponents (deep cuts weigh more below 1: the histogram pass, then the sort, take the rows the first pass
    # cannot certify), and scores a top-k of 50 cut first (every other logit -inf).
    others = {exponent: MinKLogitsProcessor(exponent) for exponent in (0.0, 0.5, 2.0)}
    for exponent, processor in others.items():
        for scores in batches[:2]:
            assert torch.equal(processor(None, scores).isfinite(), naive_min_k(scores, exponent).isfinite())
        candidates[f"min-k, exponent {exponent:g}"] = lambda p=processor: [p(None, scores) for scores in batches]
    cut = [TopKLogitsWarper(50)(None, scores) for scores in batches]
    candidates["min-k after top-k 50"] = lambda: [min_k(None, scores) for scores in cut]
    candidates["min-p after top-k 50"] = lambda: [min_p(None, scores) for scores in cut]
    times = {name: seconds / len(batches) for name, seconds in
             interleaved_medians(candidates, rounds=max(3, rounds // 3), calls=1, warmup=1).items()}  # fmt: skip
    ours, theirs = times["min-k (decodekit)"], times["min-p (decodekit)"]
    print(f"\nmin-k per call on scores [{BATCH}, {VOCAB}] (8 batches of randn * 4, the same kept sets as the loop):")
    for name, seconds in times.items():
        print(f"  {name:<24} {seconds * 1e3:9.3f} ms   {seconds / ours:6.2f}x min-k's time   "
              f"{seconds / theirs:6.2f}x min-p's")  # fmt: skip
    print(f"  min-k / min-p time: {ours / theirs:.2f}x  (target <= 2x: {verdict(ours / theirs <= 2)}; the published "
          "weighting, exponent 1)")
    after = times["min-k after top-k 50"] / times["min-p after top-k 50"]
    print(f"  after top-k 50, min-k / min-p time: {after:.2f}x; exponents 0, 0.5, 2: "
          + ", ".join(f"{times[f'min-k, exponent {e:g}'] / theirs:.2f}x" for e in others))


def samplers_per_call(rounds: int, device: str) -> None:
    generator = torch.Generator().manual_seed(1)
    scores = (torch.randn(BATCH, VOCAB, generator=generator) * 4).to(device)
    input_ids = torch.randint(0, 64, (BATCH, WINDOW), generator=generator).to(device)  # repetitive text
    breakers = {3, 4}
    seeds = torch.arange(BATCH)
    dry = DRYLogitsProcessor(0.8, sequence_breaker_ids=sorted(breakers), penalty_last_n=WINDOW)
    xtc = XTCLogitsProcessor(0.01, 0.5, seeds=seeds, prompt_length=WINDOW)
    sigma = TopNSigmaLogitsProcessor(1.0)
    pairs = {
        "DRY": (lambda: dry(input_ids, scores), lambda: naive_dry(input_ids, scores, breakers)),
        "XTC": (lambda: xtc(input_ids, scores), lambda: naive_xtc(scores, 0.01, 0.5, seeds, 0)),
        "top-n-sigma": (lambda: sigma(None, scores), lambda: naive_top_n_sigma(scores, 1.0)),
        "Mirostat": (lambda: MirostatLogitsProcessor(3.0)(input_ids, scores), lambda: naive_mirostat(scores, 3.0)),
        "p-less": (lambda: PLessLogitsProcessor(2.0)(None, scores), lambda: naive_p_less(scores, 2.0)),
    }
    for name, (ours, naive) in pairs.items():
        assert torch.allclose(ours(), naive(), rtol=1e-5, atol=1e-4), f"{name} differs from its reference"
    candidates = {f"{name} {kind}": function for name, pair in pairs.items()
                  for kind, function in zip(("(decodekit)", "(naive)"), pair, strict=True)}  # fmt: skip
    times = interleaved_medians(candidates, rounds=max(3, rounds // 3), calls=3, warmup=1)
    print(f"\nNew samplers per call on scores [{BATCH}, {VOCAB}] ({WINDOW}-token history for DRY), same results:")
    for name in pairs:
        ours, naive = times[f"{name} (decodekit)"], times[f"{name} (naive)"]
        print(f"  {name:<12} {ours * 1e3:9.3f} ms   naive per-row loop {naive * 1e3:10.3f} ms   {naive / ours:7.1f}x")


ENTROPY_SAMPLERS = {  # name: (decodekit's processor, transformers' warper, one value, per-row values)
    "Top-H": (TopHLogitsProcessor, TopHLogitsWarper, 0.4, (0.2, 0.4, 0.6, 0.8)),
    "typical": (TypicalLogitsProcessor, TypicalLogitsWarper, 0.9, (0.5, 0.7, 0.9, 0.95)),
    "epsilon": (EpsilonLogitsProcessor, EpsilonLogitsWarper, 3e-4, (1e-4, 3e-4, 1e-3, 3e-3)),
    "eta": (EtaLogitsProcessor, EtaLogitsWarper, 3e-4, (1e-4, 3e-4, 1e-3, 3e-3)),
}


def _same_kept(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    kept = torch.isfinite(ours)
    return torch.equal(kept, torch.isfinite(theirs)) and torch.equal(ours[kept], theirs[kept])


def entropy_samplers_per_call(rounds: int, device: str) -> None:
    generator = torch.Generator().manual_seed(2)
    scores = (torch.randn(BATCH, VOCAB, generator=generator) * 3).to(device)
    candidates = {}
    for name, (processor, warper, value, per_row) in ENTROPY_SAMPLERS.items():
        ours, theirs = processor(value), warper(value)
        row_values = torch.tensor(per_row).repeat(BATCH // len(per_row))
        ours_per_row = processor(row_values)
        warpers = [warper(float(v)) for v in row_values]

        def loop(scores=scores, warpers=warpers):
            return torch.cat([w(None, scores[i : i + 1]) for i, w in enumerate(warpers)])

        assert _same_kept(ours(None, scores), theirs(None, scores)), f"{name} differs from transformers' warper"
        assert _same_kept(ours_per_row(None, scores), loop()), f"{name} per row differs from a loop of warpers"
        candidates[f"{name} (decodekit)"] = lambda ours=ours: ours(None, scores)
        candidates[f"{name} (warper)"] = lambda theirs=theirs: theirs(None, scores)
        candidates[f"{name} per row (decodekit)"] = lambda ours=ours_per_row: ours(None, scores)
        candidates[f"{name} per row (warper loop)"] = loop
    times = interleaved_medians(candidates, rounds=max(3, rounds // 3), calls=3, warmup=1)
    print(f"\nEntropy samplers per call on scores [{BATCH}, {VOCAB}], the same tokens kept as transformers' warpers:")
    for name in ENTROPY_SAMPLERS:
        ours, theirs = times[f"{name} (decodekit)"], times[f"{name} (warper)"]
        row, loop = times[f"{name} per row (decodekit)"], times[f"{name} per row (warper loop)"]
        print(f"  {name:<8} {ours * 1e3:8.3f} ms   warper {theirs * 1e3:8.3f} ms   {theirs / ours:5.2f}x   "
              f"per row {row * 1e3:8.3f} ms   loop of warpers {loop * 1e3:8.3f} ms   {loop / row:5.2f}x")  # fmt: skip


def gumbel_noise_24bit(seeds: torch.Tensor, step: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The seeded noise as it was built before: 24-bit uniforms (noise never above about 17.3, and one
    bit pattern rounded to a uniform of 1.0, infinite noise). Kept here only as the cost baseline."""
    key = _mix((seeds.to(device=device, dtype=torch.int64) & MASK32) ^ _mix(torch.tensor(step, device=device)))
    bits = _mix(key[:, None] ^ _mix(torch.arange(vocab, device=device, dtype=torch.int64) + MULTIPLIERS[0]))
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(uniform))


def seeded_noise_per_call(rounds: int, device: str) -> None:
    seeds, target = torch.arange(BATCH), torch.device(device)
    candidates = {
        "32-bit (decodekit)": lambda: gumbel_noise(seeds, 7, VOCAB, target),
        "24-bit (before)": lambda: gumbel_noise_24bit(seeds, 7, VOCAB, target),
    }
    times = interleaved_medians(candidates, rounds=max(3, rounds // 3), calls=3, warmup=1)
    ours, before = times["32-bit (decodekit)"], times["24-bit (before)"]
    ratio = ours / before
    print(f"\nSeeded sampling noise per call, [{BATCH}, {VOCAB}]:")
    print(f"  32-bit {ours * 1e3:.2f} ms, 24-bit {before * 1e3:.2f} ms")
    print(f"  32-bit / 24-bit time: {ratio:.2f}x ({verdict(ratio <= 1.05)})")


def end_to_end(rounds: int, new_tokens: int, device: str) -> None:
    model, tokenizer = load_model(device_map=None if device == "cpu" else device)
    batch = {key: value.to(model.device) for key, value in encode_prompts(tokenizer, PROMPTS).items()}
    prompt_length = batch["input_ids"].shape[1]
    recipes = {
        "min-p + staged + frequency/presence": [
            StagedRepetitionPenaltyLogitsProcessor({1: 1.2, 3: 1.5, 6: 2.0}, window=WINDOW),
            FrequencyPresencePenaltyLogitsProcessor(0.3, 0.2, prompt_length=prompt_length),
            MinPLogitsProcessor(0.05, temperature=0.8),
        ],
        "DRY + top-n-sigma + XTC": [
            DRYLogitsProcessor(0.8, sequence_breaker_ids=breaker_token_ids(tokenizer, ["\n", ":", '"', "*"])),
            TopNSigmaLogitsProcessor(1.0),
            XTCLogitsProcessor(0.1, 0.5, temperature=0.8, prompt_length=prompt_length),
        ],
        "Mirostat": [MirostatLogitsProcessor(5.0, 0.1, temperature=0.8)],
    }
    common = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=0.8,
        top_k=0,
        pad_token_id=tokenizer.pad_token_id,
    )

    def run(logits_processor=None):
        torch.manual_seed(0)
        with torch.inference_mode():
            model.generate(**batch, logits_processor=logits_processor, **common)

    candidates = {"without": run}
    candidates.update({name: (lambda chain=chain: run(LogitsProcessorList(chain))) for name, chain in recipes.items()})
    times = interleaved_medians(candidates, rounds=rounds)
    print(
        f"\ngenerate on {len(PROMPTS)} prompts x {new_tokens} new tokens (default model on {device}, sampling "
        f"T=0.8), median of {rounds} rounds: without decodekit's processors {times['without']:.3f} s"
    )
    for name in recipes:
        overhead = times[name] / times["without"] - 1
        print(f"  with {name:<38} {times[name]:.3f} s  overhead {overhead * 100:+.2f}%  "
              f"(target <= +3%: {verdict(overhead <= 0.03)})")  # fmt: skip


def main() -> None:
    allocator_pinned = keep_freed_memory()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--generate-rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", choices=("min-k",), help="run one section only")
    args = parser.parse_args()
    if args.only == "min-k":
        min_k_per_call(args.rounds, args.device)
        return
    per_call(args.rounds, allocator_pinned, args.device)
    samplers_per_call(args.rounds, args.device)
    min_k_per_call(args.rounds, args.device)
    entropy_samplers_per_call(args.rounds, args.device)
    seeded_noise_per_call(args.rounds, args.device)
    if args.generate_rounds > 0:
        end_to_end(args.generate_rounds, args.new_tokens, args.device)


if __name__ == "__main__":
    main()
