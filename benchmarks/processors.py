"""Per-call time of decodekit's processors against transformers' built-ins, and their end-to-end cost.

    python benchmarks/processors.py [--rounds 15] [--generate-rounds 5]

Prints ratios measured side by side in one run, and each candidate's page faults per call. The
script first asks glibc to keep freed memory for reuse, as a long-running process does: left to
its own threshold, it hands large temporaries back to the system in some runs and not in others,
and a candidate that then pays fresh pages on every call looks up to twice as slow.

Ratios:
  1. min-p vs MinPLogitsWarper on scores [32, 49152]            (target: ours >= 5x faster)
  2. staged penalty (512-token window) vs RepetitionPenalty      (target: ours <= 2x its time)
  3. generate on the default model, batch 8, 64 new tokens, sampling with and without our
     processors                                                  (target: <= 3% slower)
"""

from __future__ import annotations

import argparse

import torch
from _timing import (  # benchmarks/ is on sys.path when a script in it runs
    interleaved_medians,
    keep_freed_memory,
    page_faults_per_call,
    verdict,
)
from transformers import LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from decodekit import (
    FrequencyPresencePenaltyLogitsProcessor,
    MinPLogitsProcessor,
    StagedRepetitionPenaltyLogitsProcessor,
    encode_prompts,
    load_model,
)

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


def per_call(rounds: int, allocator_pinned: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(BATCH, VOCAB, generator=generator) * 4
    input_ids = torch.randint(0, VOCAB, (BATCH, WINDOW), generator=generator)
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


def end_to_end(rounds: int, new_tokens: int) -> None:
    model, tokenizer = load_model()
    batch = encode_prompts(tokenizer, PROMPTS)
    prompt_length = batch["input_ids"].shape[1]
    processors = LogitsProcessorList(
        [
            StagedRepetitionPenaltyLogitsProcessor({1: 1.2, 3: 1.5, 6: 2.0}, window=WINDOW),
            FrequencyPresencePenaltyLogitsProcessor(0.3, 0.2, prompt_length=prompt_length),
            MinPLogitsProcessor(0.05, temperature=0.8),
        ]
    )
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

    times = interleaved_medians({"without": run, "with": lambda: run(processors)}, rounds=rounds)
    overhead = times["with"] / times["without"] - 1
    print(
        f"\ngenerate on {len(PROMPTS)} prompts x {new_tokens} new tokens (default model, sampling T=0.8), "
        f"median of {rounds} rounds:"
    )
    print(f"  without our processors {times['without']:.3f} s, with all three {times['with']:.3f} s")
    print(f"  overhead: {overhead * 100:+.2f}%  (target <= +3%: {verdict(overhead <= 0.03)})")


def main() -> None:
    allocator_pinned = keep_freed_memory()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--generate-rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    per_call(args.rounds, allocator_pinned)
    if args.generate_rounds > 0:
        end_to_end(args.generate_rounds, args.new_tokens)


if __name__ == "__main__":
    main()
