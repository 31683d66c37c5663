"""decodekit's beam search against transformers' built-in one, and what each normalization does.

    python benchmarks/beam_search.py [--rounds 5] [--max-new-tokens 64]

Prints, measured side by side in one run on the default model (4 prompts, 4 beams):
  1. wall time of generate with decodekit's beam search / with the built-in one, both with the
     same ("average") normalization, and whether their outputs are identical
                                                                 (target: <= 1.0x, identical)
  2. for a few prompts, the length of the returned text under "none", "average" and "gnmt"
"""

from __future__ import annotations

import argparse

import torch
from _timing import interleaved_medians, verdict  # benchmarks/ is on sys.path when a script in it runs

from decodekit import encode_prompts, load_model
from decodekit.decoders import beam_search

PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain gravity to a child.",
    "Give three tips for learning a language.",
]
NORMALIZATIONS = {
    "none": {"length_normalization": "none"},
    "average (alpha 1)": {"length_normalization": "average", "length_alpha": 1.0},
    "gnmt (alpha 0.6)": {"length_normalization": "gnmt", "length_alpha": 0.6},
}


def compare_with_built_in(model, tokenizer, rounds: int, max_new_tokens: int) -> None:
    batch = encode_prompts(tokenizer, PROMPTS)
    common = {"num_beams": 4, "max_new_tokens": max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
    common.update(return_dict_in_generate=True, output_scores=True, length_penalty=1.0)

    def built_in():
        return model.generate(**batch, **common)

    def ours():
        return model.generate(**batch, custom_generate=beam_search, **common)

    reference, output = built_in(), ours()
    identical = torch.equal(reference.sequences, output.sequences)
    score_gap = (reference.sequences_scores - output.sequences_scores).abs().max().item()
    generated = output.sequences.shape[1] - batch["input_ids"].shape[1]
    times = interleaved_medians({"built-in": built_in, "decodekit": ours}, rounds=rounds, warmup=0)
    ratio = times["decodekit"] / times["built-in"]
    print(f"beam search, {len(PROMPTS)} prompts x 4 beams, up to {max_new_tokens} new tokens ({generated} generated)")
    print(f"  built-in   {times['built-in']:.2f} s (median of {rounds})")
    print(f"  decodekit  {times['decodekit']:.2f} s")
    print(f"  decodekit / built-in time: {ratio:.3f}x  (target <= 1.0x: {verdict(ratio <= 1.0)})")
    print(f"  outputs identical: {identical}; largest sequences_scores gap {score_gap:.2e}")


def normalization_lengths(model, tokenizer, max_new_tokens: int) -> None:
    batch = encode_prompts(tokenizer, PROMPTS)
    prompt_length = batch["input_ids"].shape[1]
    print(f"\nlength of the best hypothesis (new tokens, EOS excluded), 4 beams, up to {max_new_tokens}")
    lengths = {}
    for name, settings in NORMALIZATIONS.items():
        output = model.generate(
            **batch,
            custom_generate=beam_search,
            num_beams=4,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            early_stopping="never",
            **settings,
        )
        new_tokens = output[:, prompt_length:]
        lengths[name] = (new_tokens != tokenizer.pad_token_id).sum(dim=1).tolist()
    print(f"  {'prompt':44s}" + "".join(f"{name:>20s}" for name in lengths))
    for index, prompt in enumerate(PROMPTS):
        print(f"  {prompt:44s}" + "".join(f"{values[index]:>20d}" for values in lengths.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each candidate")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    compare_with_built_in(model, tokenizer, args.rounds, args.max_new_tokens)
    normalization_lengths(model, tokenizer, args.max_new_tokens)


if __name__ == "__main__":
    main()
