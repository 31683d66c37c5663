"""The allowed values and defaults of every user-facing setting, in one place that imports no torch.

The components check their arguments against these values, and the command line shows them in
its help, so ``decodekit --help`` answers without loading torch and no range is written twice.
"""

from __future__ import annotations

# Sampling. Temperatures that float32 logits survive: logits / 1e-6 stay finite for any logit below
# 1e32, and logits / 1e4 keep their order. Outside, sampling would divide into inf or NaN.
TEMPERATURE_RANGE = (1e-6, 1e4)

# OpenAI-style frequency and presence penalties.
PENALTY_RANGE = (-2.0, 2.0)

# DRY: the penalty's scale and growth, and the longest match it measures (text-generation-webui's).
DRY_MULTIPLIER_RANGE = (0.0, 100.0)  # open at 0: a zero multiplier is DRY switched off
DRY_BASE_RANGE = (1.0, 10.0)
DRY_MAX_MATCH = 50
DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")

# Mirostat v2: the target surprise in bits (open at 0) and the learning rate (open at 0).
MIROSTAT_TAU_RANGE = (0.0, 64.0)
MIROSTAT_ETA_RANGE = (0.0, 1.0)
ADAPTIVE_P_DECAY_RANGE = (0.0, 0.99)  # llama.cpp clamps the decay to 0.99
TOP_N_SIGMA_RANGE = (0.0, 1e4)
P_LESS_ORDER_RANGE = (1.0, 64.0)  # the Rényi order of p-less's threshold (open at 1); 2 is the paper's
MIN_K_EXPONENT_RANGE = (0.0, 4.0)  # min-k's rank weighting rank^-exponent; 1 is the published 1 / rank

# Beam search. Each step ranks 2 x beams candidates per request over the whole vocabulary; far
# beyond MAX_BEAMS the allocation fails before the first token.
MAX_BEAMS = 256
NORMALIZATIONS = ("none", "average", "gnmt")
# Length normalization bounds within which float32 beam scores stay finite for any reachable
# length (a million tokens to the 5th power is 1e30) and a per-token reward stays on the scale of
# log-probabilities. Beyond them a score no longer ranks anything.
ALPHA_RANGE = (0.0, 5.0)
REWARD_RANGE = (0.0, 10.0)
EARLY_STOPPING = (True, False, "never")

# The compressed cache always keeps its first (sink) tokens and a recent window.
DEFAULT_SINK_TOKENS = 4
DEFAULT_RECENT_TOKENS = 32
KV_BITS = (16, 8, 5, 4, 3, 2)  # a compressed cache's storage widths (None: the model's dtype)
CODED_BITS = (8, 5, 4, 3, 2)  # the widths stored as integer codes with group scales (16: the entries themselves)
# How a compressed cache ranks its tokens: each scorer's name and its class (one file each in decodekit/cache/scorers/).
# A new scorer is its file and one row here.
KV_SCORERS = {
    "attention": "decodekit.cache.scorers.attention:AttentionScorer",
    "reconstruction": "decodekit.cache.scorers.reconstruction:ReconstructionScorer",
    "attention+novelty": "decodekit.cache.scorers.novelty:NoveltyScorer",
}
KV_SCORINGS = tuple(KV_SCORERS)
# How reconstruction scores are had: a replay pass over the prompt ("forward"), estimated in the prompt's own pass
# ("prompt_queries"), or ("auto") the estimate where a head keeps on average at least ESTIMATE_FROM_SHARE of the
# prompt's tokens or the model has sliding-window layers, and the replay pass below (where the estimate's allocation
# across layers loses).
KV_REPLAYS = ("auto", "forward", "prompt_queries")
ESTIMATE_FROM_SHARE = 0.5

# Generation.
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
