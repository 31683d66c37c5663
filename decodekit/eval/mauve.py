"""MAUVE (Pillutla et al. 2021) between generated and reference texts, on features of a local model.

The recipe of the reference implementation, with the feature model swapped for the one at hand:
each text becomes the final hidden state of its last token; the features of both sets are
L2-normalized, reduced by PCA to the components explaining ``explained_variance`` of the variance,
and quantized together by k-means into ``clusters`` buckets (default: a tenth of the smaller set, as
mauve-text's ``num_buckets="auto"``). The
two bucket histograms P (references) and Q (generations) give a divergence curve
``(exp(-c KL(Q || R)), exp(-c KL(P || R)))`` over mixtures ``R = w P + (1 - w) Q``; MAUVE is the
area under it, 1 for identical distributions and near 0 for disjoint ones.

The authors' ``mauve-text`` (with faiss and scikit-learn) is the test oracle: on the same features,
averaged over five k-means seeds, the two agree within 0.02 where MAUVE is near 1 or near 0 and
within 0.06 in between, on 200 texts a side (``tests/test_mauve.py``); one seed of ours varies more
than one of mauve-text's (its k-means runs fewer iterations). decodekit keeps its own
so that MAUVE runs on torch alone, on any device, with no further dependency.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch


def text_features(
    texts: Sequence[str], model: Any, tokenizer: Any, *, max_length: int = 256, batch_size: int = 16
) -> torch.Tensor:
    """``[len(texts), hidden]``: the last layer's hidden state at each text's last token.

    Texts go through the model ``batch_size`` at a time, padded on the right: a causal model's state at
    a text's last token never sees the padding after it (the same values as one text at a time, up to
    float rounding), and a batch costs about what one text does on a CPU.

    Example (with ``model`` and ``tokenizer`` from ``load_model``)::

        features = text_features(["The sea is calm tonight.", "Hello"], model, tokenizer)  # [2, hidden]
    """
    device = next(model.parameters()).device
    encoded = [tokenizer(text, add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"]
               for text in texts]  # fmt: skip
    if any(not ids for ids in encoded):
        raise ValueError("a text for MAUVE has no tokens: drop empty texts first")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    features = []
    with torch.inference_mode():
        for start in range(0, len(encoded), batch_size):
            batch = encoded[start : start + batch_size]
            width = max(len(ids) for ids in batch)
            ids = torch.tensor([row + [pad] * (width - len(row)) for row in batch], device=device)
            mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in batch], device=device)
            output = model(ids, attention_mask=mask, output_hidden_states=True)
            last = torch.tensor([len(row) - 1 for row in batch], device=device)
            features.append(output.hidden_states[-1][torch.arange(len(batch), device=device), last].float().cpu())
    return torch.cat(features) if features else torch.empty(0)


def _kmeans(points: torch.Tensor, clusters: int, *, seed: int, rounds: int = 5, steps: int = 100) -> torch.Tensor:
    """Cluster labels from the best (lowest inertia) of ``rounds`` k-means++ runs."""
    generator = torch.Generator().manual_seed(seed)
    best_labels, best_inertia = None, math.inf
    for _ in range(rounds):
        centers = points[torch.randint(len(points), (1,), generator=generator)]
        while len(centers) < clusters:
            distance = torch.cdist(points, centers).min(dim=1).values ** 2
            weights = distance / distance.sum() if distance.sum() > 0 else torch.full_like(distance, 1 / len(points))
            centers = torch.cat([centers, points[torch.multinomial(weights, 1, generator=generator)]])
        for _ in range(steps):
            labels = torch.cdist(points, centers).argmin(dim=1)
            moved = torch.stack(
                [points[labels == k].mean(dim=0) if bool((labels == k).any()) else centers[k] for k in range(clusters)]
            )
            if torch.allclose(moved, centers):
                break
            centers = moved
        labels = torch.cdist(points, centers).argmin(dim=1)
        inertia = float(((points - centers[labels]) ** 2).sum())
        if inertia < best_inertia:
            best_labels, best_inertia = labels, inertia
    return best_labels


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    support = p > 0
    return float((p[support] * (p[support] / q[support]).log()).sum())


def mauve_from_histograms(p: torch.Tensor, q: torch.Tensor, *, scaling: float = 5.0, points: int = 25) -> float:
    """The area under the divergence curve of two histograms over the same buckets.

    Example:
        >>> import torch
        >>> round(mauve_from_histograms(torch.tensor([0.5, 0.5]), torch.tensor([0.5, 0.5])), 6)
        1.0
    """
    p, q = p.double() / p.sum(), q.double() / q.sum()
    curve = [(0.0, 1.0), (1.0, 0.0)]
    for weight in torch.linspace(1e-6, 1 - 1e-6, points).tolist():
        mixture = weight * p + (1 - weight) * q
        curve.append((math.exp(-scaling * _kl(q, mixture)), math.exp(-scaling * _kl(p, mixture))))
    curve.sort(key=lambda point: (point[0], -point[1]))  # the curve falls as it goes right
    return sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in itertools.pairwise(curve))


def mauve(
    predictions: Sequence[str] | torch.Tensor,
    references: Sequence[str] | torch.Tensor,
    model: Any = None,
    tokenizer: Any = None,
    *,
    clusters: int | None = None,
    explained_variance: float = 0.9,
    scaling: float = 5.0,
    seed: int = 25,
) -> float:
    """MAUVE between generated ``predictions`` and human ``references`` (texts, or feature tensors).

    Needs at least two texts on each side. ``model``/``tokenizer`` compute the features of texts.

    Example (with ``model`` and ``tokenizer`` from ``load_model``)::

        score = mauve(generations, human_texts, model, tokenizer)
    """
    if len(predictions) < 2 or len(references) < 2:
        raise ValueError("mauve needs at least two predictions and two references")
    if not 0 < explained_variance <= 1:
        raise ValueError(f"explained_variance must be in (0, 1]; got {explained_variance!r}")
    texts_given = not isinstance(predictions, torch.Tensor) or not isinstance(references, torch.Tensor)
    if texts_given and (model is None or tokenizer is None):
        raise ValueError("model and tokenizer are needed to compute the features of texts")
    q_features = predictions if isinstance(predictions, torch.Tensor) else text_features(predictions, model, tokenizer)
    p_features = references if isinstance(references, torch.Tensor) else text_features(references, model, tokenizer)
    features = torch.nn.functional.normalize(torch.cat([p_features, q_features]).double(), dim=1)
    centered = features - features.mean(dim=0)
    _, singular, vectors = torch.linalg.svd(centered, full_matrices=False)
    variance = singular**2 / (singular**2).sum()
    keep = int((variance.cumsum(0) < explained_variance).sum()) + 1
    reduced = centered @ vectors[:keep].T
    # As mauve-text's num_buckets="auto": a tenth of the smaller side.
    count = clusters if clusters is not None else max(2, round(min(len(p_features), len(q_features)) / 10))
    if not 1 <= count <= len(features):
        raise ValueError(f"clusters must be between 1 and the number of texts ({len(features)}); got {count}")
    labels = _kmeans(reduced, count, seed=seed)
    p = torch.bincount(labels[: len(p_features)], minlength=count)
    q = torch.bincount(labels[len(p_features) :], minlength=count)
    return mauve_from_histograms(p, q, scaling=scaling)
