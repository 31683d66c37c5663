"""The decoding steps a layer has stored but not yet scored: their query columns and rotary embedding.

Between evictions a layer appends each decoding step's token and leaves the step's scoring for the next eviction,
which scores all the waiting steps at once (``AttentionScorer.flush``). A step is kept as it comes (a list: no
operator per step).
"""

from __future__ import annotations

import torch

Step = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # query columns [batch, 1, -], cos and sin [batch, 1, -]


class WaitingSteps:
    """Steps waiting for their scoring, in the order they came (their tokens follow each segment's other entries).

    Example:
        >>> waiting = WaitingSteps()
        >>> waiting.add((torch.ones(1, 1, 4), torch.ones(1, 1, 2), torch.zeros(1, 1, 2)), scaling=0.5)
        >>> waiting.add((torch.zeros(1, 1, 4), torch.ones(1, 1, 2), torch.zeros(1, 1, 2)), scaling=0.5)
        >>> len(waiting)
        2
        >>> [part.shape for part in waiting.take()]
        [torch.Size([1, 2, 4]), torch.Size([1, 2, 2]), torch.Size([1, 2, 2])]
        >>> len(waiting)
        0
    """

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.scaling = 1.0  # the queries' scaling (the same for every step of a layer)

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, step: Step, scaling: float) -> None:
        """Queue ``step``, whose queries are scaled by ``scaling``."""
        self.scaling = scaling
        self.steps.append(step)

    def take(self) -> Step:
        """The waiting steps, each part ``[batch, steps, -]`` in their order, and forget them."""
        steps, self.steps = self.steps, []
        if len(steps) == 1:
            return steps[0]
        return tuple(torch.cat(parts, dim=1) for parts in zip(*steps, strict=True))

    def clear(self) -> None:
        """Forget the waiting steps (their caller took them as they are, ``steps``)."""
        self.steps = []

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor held for the waiting steps."""
        return [part for step in self.steps for part in step]
