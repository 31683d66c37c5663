"""The decoding steps a layer has stored but not yet scored: their query columns and rotation.

Between evictions a layer appends each decoding step's token to its reserved room and leaves the step's
scoring for the next eviction, which scores all the waiting steps at once (``EntryScoring._score_waiting``).

Eagerly, a step is kept as it comes (a list: no operator per step). Inside a compiled step it is written into
tensors with room for a whole eviction interval, at an index held in a tensor beside them: a list's length would
be a guard of its own in every compiled graph, one graph per count, and so would a count read on the host where
it is 0 (dynamo compiles a size or index of 0 or 1 apart), so the steps between evictions read no count and run
one graph.
"""

from __future__ import annotations

import torch

Step = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # query columns [batch, 1, -], cos and sin [batch, 1, -]


class WaitingSteps:
    """Steps waiting for their scoring, in the order they came (their tokens are the layer's last entries).

    Example:
        >>> waiting = WaitingSteps()
        >>> waiting.add((torch.ones(1, 1, 4), torch.ones(1, 1, 2), torch.zeros(1, 1, 2)), scaling=0.5, room=8)
        >>> waiting.add((torch.zeros(1, 1, 4), torch.ones(1, 1, 2), torch.zeros(1, 1, 2)), scaling=0.5, room=8)
        >>> len(waiting)
        2
        >>> [part.shape for part in waiting.take()]
        [torch.Size([1, 2, 4]), torch.Size([1, 2, 2]), torch.Size([1, 2, 2])]
        >>> len(waiting)
        0
    """

    def __init__(self) -> None:
        self.steps: list[Step] = []  # kept eagerly
        self.held: Step | None = None  # the compiled steps' tensors, [batch, room, -] each
        self.slot: torch.Tensor | None = None  # [1]: where the next compiled step goes in them
        self.count = 0  # how many of ``held``'s first steps wait (written, not read, by a compiled step)
        self.scaling = 1.0  # the queries' scaling

    def __len__(self) -> int:
        return self.count + len(self.steps)

    def add(self, step: Step, scaling: float, room: int) -> None:
        """Queue ``step``, whose queries are scaled by ``scaling`` (the same for every step of a layer); ``room`` is
        how many steps may wait at most (the compiled steps' tensors are made that long)."""
        self.scaling = scaling
        if not torch.compiler.is_compiling():
            self.steps.append(step)
            return
        if self.held is None or any(
            held.shape[0] != part.shape[0] or held.shape[1] < room or held.shape[2:] != part.shape[2:]
            or held.dtype != part.dtype or held.device != part.device
            for held, part in zip(self.held, step, strict=True)
        ):  # fmt: skip
            self.held = tuple(part.new_empty((part.shape[0], room, *part.shape[2:])) for part in step)
            self.slot = torch.full((1,), self.count, dtype=torch.long, device=step[0].device)
        if self.steps:  # steps taken eagerly before this compiled one: they go first
            for earlier in self.steps:
                self._write(earlier)
            self.steps = []
        self._write(step)

    def _write(self, step: Step) -> None:
        for held, part in zip(self.held, step, strict=True):
            held.index_copy_(1, self.slot, part)
        self.slot += 1
        self.count += 1

    def take(self) -> Step:
        """The waiting steps, each part ``[batch, steps, -]`` in their order, and forget them."""
        parts = []
        if self.count:
            parts.append(tuple(held.narrow(1, 0, self.count) for held in self.held))
        parts.extend(self.steps)
        self.clear()
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(group, dim=1) for group in zip(*parts, strict=True))

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor held for the waiting steps (the compiled steps' tensors whole)."""
        return [*(self.held or ()), *(part for step in self.steps for part in step)]

    def clear(self) -> None:
        if self.count:
            self.slot.zero_()
        self.count, self.steps = 0, []
