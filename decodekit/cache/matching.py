"""Attention matching: refit what a layer keeps of its prompt so that attention over the kept entries reproduces
attention over all of them (the "Attention Matching" of Zweiger et al., 2026, "Fast KV Compaction via Attention
Matching", on the entries a ranking chose).

For one row and KV head, reference queries ``q`` (the prompt's own queries placed after the prompt, as a replay
places them: in a model's first layer exactly the replay's, since a query there depends on its token alone), the
``n`` entries the prompt left ``(k, v)`` and the ``t`` kept ones ``S``:

- **mass**: a query's attention mass over the kept entries, ``sum_j exp(q.k_j + b_j)``, should be its mass over all
  ``n``, so that the tokens that come later share attention with the prompt as they would have. With ``w_j =
  exp(b_j)`` this is linear in ``w >= 0``: a nonnegative least-squares fit, and ``b_j`` is a log-mass bias added
  to entry ``j``'s logit whenever attention reads it;
- **outputs**: the attention output over the kept entries with those biases, ``softmax(q.k_S + b) C``, should be the
  output over all entries, ``softmax(q.k) v``: a ridge regression for the kept values ``C``, pulled toward their
  own values ``v_S``.

The keys stay as they are, so the entries keep their positions and their codes' turn.
"""

from __future__ import annotations

import math

import torch

# Reference queries held at once while the attention over every entry is computed (bounds memory to this many
# rows of logits).
QUERY_BLOCK = 1024
# How strongly the fitted values are pulled toward the kept entries' own values: a multiple of the mean diagonal of
# the regression's normal matrix. Chosen on the tuning texts (0.3 against 1 and 0.1).
RIDGE = 0.3
MASS_ITERATIONS = 200  # projected-gradient steps of the mass fit
# How strongly the biases' weights are pulled toward the uniform weight: a multiple of the mean diagonal of the mass
# fit's normal matrix.
MASS_RIDGE = 0.01
# The least weight a kept entry's bias may give it, as a share of the uniform weight. The unconstrained mass fit
# leaves about half of a first-layer head's kept entries at zero weight; floors of 0.1 and 0.3 kept them all
# visible but changed neither perplexity nor retrieval on the tuning texts and the choosing task set, so none.
MASS_FLOOR = 0.0


@torch.no_grad()
def matched_entries(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
    *,
    ridge: float = RIDGE,
    iterations: int = MASS_ITERATIONS,
    floor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-mass biases ``[t]`` and values ``[t, head_dim]`` (float32) of the ``kept`` entries (``[t]`` indices
    into ``keys``) such that attention over them matches attention over every entry for ``queries``.

    Args:
        queries: ``[m, head_dim]`` reference queries, already scaled (a logit is ``query . key``) and placed.
        keys: ``[n, head_dim]`` every entry's key, as the queries read it.
        values: ``[n, head_dim]`` every entry's value.
        kept: ``[t]`` the indices of the entries that stay (any order; the results follow it).
        ridge: how strongly each fitted value is pulled toward the entry's own (a multiple of the mean diagonal of
            the regression's normal matrix), > 0.
        iterations: projected-gradient steps of the nonnegative mass fit.
        floor: the least weight ``exp(bias)`` an entry may get, as a share of the uniform weight (>= 0; None:
            ``MASS_FLOOR``).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> queries, keys, values = torch.randn(64, 8), torch.randn(16, 8), torch.randn(16, 8)
        >>> biases, fitted = matched_entries(queries, keys, values, torch.arange(16))  # nothing evicted: no change
        >>> bool(biases.abs().max() < 1e-4), bool(torch.allclose(fitted, values, atol=1e-4))
        (True, True)
    """
    kept = kept.to(device=keys.device, dtype=torch.long)
    own = values[kept].float()
    if queries.shape[0] == 0 or kept.numel() == 0:
        return own.new_zeros(kept.numel()), own
    shares, outputs = _kept_shares_and_outputs(queries.float(), keys.float(), values.float(), kept)
    weights = _mass_weights(shares, iterations, floor=MASS_FLOOR if floor is None else floor)
    # The kept entries' attention with the biases: each query's shares reweighted and normalised.
    attention = shares * weights
    attention /= attention.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    normal = attention.T @ attention
    pull = ridge * normal.diagonal().mean().clamp(min=torch.finfo(torch.float32).tiny)
    normal.diagonal().add_(pull)
    fitted = torch.linalg.solve(normal, attention.T @ outputs + pull * own)
    return weights.log(), fitted


def _kept_shares_and_outputs(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the kept entries' shares of its attention over every entry, ``[m, t]``, and its attention output
    over every entry, ``[m, head_dim]``, a block of queries at a time."""
    shares = queries.new_empty((queries.shape[0], kept.numel()))
    outputs = queries.new_empty((queries.shape[0], values.shape[-1]))
    for start in range(0, queries.shape[0], QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, queries.shape[0])
        attention = torch.softmax(queries[start:stop] @ keys.T, dim=-1)
        shares[start:stop] = attention[:, kept]
        torch.matmul(attention, values, out=outputs[start:stop])
    return shares, outputs


def _mass_weights(shares: torch.Tensor, iterations: int, pull: float = MASS_RIDGE, floor: float = 0.0) -> torch.Tensor:
    """``w`` ``[t]``, each at least ``floor * u``, minimising ``|shares @ w - 1|^2 + p |w - u|^2``: each query's mass
    over the kept entries, each weighed by ``w_j``, equal to its mass over all entries (the shares are of that mass),
    pulled toward the uniform weight ``u`` that is right on average (``p``: ``pull`` times the mean diagonal of
    ``shares^T shares``), which keeps the fit well posed where queries attend alike.

    The unconstrained solution (normal equations) clamped to the nonnegative weights, then ``iterations`` of
    accelerated projected gradient (FISTA, step one over the largest eigenvalue); with ``floor`` 0, floored at a tiny
    positive weight so that its log stays finite."""
    gram = shares.T @ shares
    uniform = 1.0 / shares.sum(dim=-1).mean().clamp(min=torch.finfo(torch.float32).tiny)
    tiny = (floor * uniform).clamp(min=1e-12)
    strength = pull * gram.diagonal().mean().clamp(min=torch.finfo(torch.float32).tiny)
    gram.diagonal().add_(strength)
    target = shares.sum(dim=0) + strength * uniform
    weights = torch.linalg.solve(gram, target).clamp(min=tiny)
    step = 1.0 / _largest_eigenvalue(gram)
    previous, momentum, point = weights, 1.0, weights
    for _ in range(iterations):
        current = (point - step * (gram @ point - target)).clamp(min=tiny)
        following = (1 + math.sqrt(1 + 4 * momentum * momentum)) / 2
        point = current + ((momentum - 1) / following) * (current - previous)
        previous, momentum = current, following
    return previous


def _largest_eigenvalue(matrix: torch.Tensor, iterations: int = 30) -> torch.Tensor:
    """The largest eigenvalue of a symmetric positive semi-definite ``matrix``, from above: the power iteration's
    estimate times 1.05 (a step over its inverse stays stable), from a positive start (the matrix is nonnegative)."""
    vector = torch.ones(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)
    for _ in range(iterations):
        vector = matrix @ vector
        vector /= vector.norm().clamp(min=torch.finfo(matrix.dtype).tiny)
    return (vector @ matrix @ vector).clamp(min=torch.finfo(matrix.dtype).tiny) * 1.05


# Reference queries per KV head at most: the prompt's queries of the heads sharing it, evenly spread over its tokens.
MATCH_QUERIES = 8192
# A row and KV head is refit only where it keeps at most this share of the prompt's entries. The fit costs about
# (reference queries) x (kept entries)^2; where first-layer heads kept more (2,700 to 3,050 of 3,072 tokens with
# half the tokens evicted, or a quarter of the bytes), refitting them gained nothing measurable on the tuning texts
# (+0.22% against +0.19%, +0.29% against +0.29%) for 35-40% more prefill time; where they keep 5-13% (75% evicted,
# a tenth of the bytes), it halved the loss.
MATCH_KEPT_SHARE = 0.25
# Nor where it keeps less than this share: with so few entries the fit moves them far from what they held to stand
# for the whole prompt, which served the prompt's own queries but cost retrieval. The first layer's heads kept 2-3.7%
# of the prompt at 90% evicted and at a twentieth of the bytes (tuning texts, retrieval contexts), where refitting
# them lowered perplexity (+4.51% to +3.95%, +2.77% to +2.13%) but lost 2 and 4 of 19 single-key tasks of the set
# settings are chosen on; they kept 5-18% at 75% evicted and a tenth of the bytes, where the refit lost none.
MATCH_KEPT_SHARE_LEAST = 0.045


def spread(rows: torch.Tensor, most: int) -> torch.Tensor:
    """At most ``most`` of ``rows`` (``[n, ...]``), evenly spread, the first and last included.

    Example:
        >>> spread(torch.arange(10), 4).tolist(), spread(torch.arange(3), 4).tolist()
        ([0, 3, 6, 9], [0, 1, 2])
    """
    if rows.shape[0] <= most:
        return rows
    return rows[torch.linspace(0, rows.shape[0] - 1, most, device=rows.device).round().long()]


@torch.no_grad()
def refit(layer, step, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Refit each row and KV head's kept prompt entries in ``layer`` (just evicted) against every prompt entry it
    held before (``keys`` and ``values``, ``[batch, heads, length, head_dim]``, as attention read them, each at its
    position's slot) for the prompt's own queries (``step``, the prompt's ``layer.Pass``) placed after the prompt:
    biases and values, through the layer's storage and coding. True when some row and head was refit.

    Rows and heads that keep more than ``MATCH_KEPT_SHARE`` of the prompt or less than ``MATCH_KEPT_SHARE_LEAST``
    are left as they are."""
    from decodekit.cache.replay_estimate import moved_back, rotation_past

    batch, kv_heads, length, head_dim = keys.shape
    storage = layer.storage
    lengths = storage.lengths_host
    most = math.floor(MATCH_KEPT_SHARE * length)
    least = math.ceil(MATCH_KEPT_SHARE_LEAST * length)
    chosen = (lengths >= least) & (lengths <= most)
    if length < 2 or not bool(chosen.any()):
        return False
    queries = step.queries().float() * step.scaling  # [batch, heads, length, head_dim]
    moved = moved_back(keys.float(), *rotation_past(step.cos, step.sin), layer.coding.rotated_reads)
    group = queries.shape[1] // kv_heads
    stop = int(lengths[chosen].max())
    positions = storage.read("positions", stop).long()
    biases = torch.zeros((batch, kv_heads, stop), device=keys.device)
    fitted = torch.zeros((batch, kv_heads, stop, head_dim), device=keys.device)
    for row, head in zip(*chosen.nonzero(), strict=True):
        count = int(lengths[row, head])
        index = positions[row, head, :count]
        reference = spread(queries[row, head * group : (head + 1) * group].reshape(-1, head_dim), MATCH_QUERIES)
        bias, values_fitted = matched_entries(reference, moved[row, head], values[row, head].float(), index)
        biases[row, head, :count], fitted[row, head, :count] = bias, values_fitted
    lanes = torch.from_numpy(chosen).to(keys.device)[..., None] & storage.valid(stop)
    slots = torch.arange(stop, device=keys.device).expand(batch, kv_heads, stop)
    storage.write_slots(slots, {"biases": biases}, lanes)
    layer.coding.write_values(storage, slots, fitted, positions, lanes)
    if "value_norms" in storage.fields:
        storage.write_slots(slots, {"value_norms": fitted.norm(dim=-1)}, lanes)
    return True
