"""How a compressed cache layer counts the tokens it has seen (its logical length, from which positions follow), and
the live entries of its rows.

Eager passes count on the host, Python numbers. Compiled decoding steps under a budget in tokens count the tokens seen
on the device instead, in a 0-d int64 tensor updated in place, as transformers' StaticLayer keeps its
``cumulative_length``: a number that changed at every step would be an input of the step's graph, and CUDA graphs
(``torch.compile(mode="reduce-overhead")``) record a graph anew for each new value of one. The host reads the count
back once, outside any step, when it next needs it; the prompt's pass (or a crop) writes the host's count there, so
that the first compiled step runs the graph of every later one. Compiled steps that fill a room made for the whole
budget (a prompt shorter than the budget: ``Eviction._grows_in_graph``) leave the live entries counted by ``live``
alone, and the host counts them again from it when it next reads them.

``SeenCount`` and ``LiveCount`` are mixins of ``CompressedLayer``, which calls ``_start_count`` when it is made.
"""

from __future__ import annotations

import torch

from decodekit.cache.storage import mark_static


class SeenCount:
    """The tokens a ``CompressedLayer`` has seen, padding included: ``seen``, and its twin on the device."""

    def _start_count(self, on_device: bool) -> None:
        """Start at 0; ``on_device``: whether compiled steps count on the device (a budget in tokens)."""
        self._seen = 0
        self._seen_device: torch.Tensor | None = None  # made on the first pass (``_make_device_count``)
        self._seen_device_current = False  # whether ``_seen_device`` holds the count (compiled steps keep it so)
        self._seen_on_device = False  # whether compiled steps counted since the host last read the count
        self._counts_on_device = on_device

    def _make_device_count(self, like: torch.Tensor) -> None:
        """On the first pass: the tensor compiled steps count in, on ``like``'s device (none where they do not)."""
        self._seen_device = None
        if self._counts_on_device:
            self._seen_device = like.new_zeros((), dtype=torch.long)
            mark_static(self._seen_device)

    @property
    def seen(self) -> int:
        """Tokens given to this layer, padding included: the logical length (after compiled decoding steps, read
        back from the device once)."""
        if self._seen_on_device:
            self._seen, self._seen_on_device = int(self._seen_device), False
        return self._seen

    @seen.setter
    def seen(self, value: int) -> None:
        self._seen, self._seen_on_device = value, False
        self._sync_device_count()

    def _sync_device_count(self) -> None:
        """Give the device's count the host's, outside any compiled step (where the layer counts on the device), so
        that the next compiled step finds it current and runs the graph every later step runs: a pass of several
        tokens (a prompt) or a count set by hand (crop, reset) does this; an eager decoding step does not, to stay one
        operator lighter, and a compiled step after it starts from the host's count in a graph of its own."""
        self._seen_device_current = False
        if self._seen_device is not None and not torch.compiler.is_compiling():
            self._seen_device.fill_(self._seen)
            self._seen_device_current = True

    def _seen_now(self) -> int | torch.Tensor:
        """``seen`` as the code of a decoding step uses it: inside a compiled step that counts on the device, the
        0-d tensor (the host's number lags there), else the number."""
        if self._seen_device_current and torch.compiler.is_compiling():
            return self._seen_device
        return self.seen  # (compiled steps that counted on the device left it current: the branch above)

    def _add_seen(self, new: int) -> None:
        """Count ``new`` more tokens seen: on the device inside a compiled step that counts there, else on the host."""
        if self._counts_on_device and self._seen_device is not None and torch.compiler.is_compiling():
            if not self._seen_device_current:  # eager passes counted on the host since: start from their count
                self._seen_device.fill_(self.seen)
            self._seen_device.add_(new)
            self._seen_device_current = self._seen_on_device = True
        elif self._seen_on_device:  # the first eager pass after compiled steps: read their count back
            self.seen = self.seen + new
        else:
            self._seen += new
            if new > 1:
                self._sync_device_count()
            else:
                self._seen_device_current = False


class LiveCount:
    """The host's counts of each row's live entries (``live_by_group``, ``live_range``), which compiled steps growing
    into a room made for the whole budget leave stale (``_live_counts_stale``): read outside a compiled step, they
    are counted again from ``live`` first (``Eviction._recount``); inside one, their last values stand (such a step
    reads them only where those values decide the same)."""

    @property
    def live_by_group(self) -> dict:
        """Live entries per group of rows (one padding and one allocated share)."""
        self._count_live_again()
        return self._live_by_group

    @live_by_group.setter
    def live_by_group(self, value: dict) -> None:
        self._live_by_group, self._live_counts_stale, self._live_added = value, False, 0

    @property
    def live_range(self) -> tuple[int, int]:
        """The least and most live entries of any row."""
        self._count_live_again()
        return self._live_range

    @live_range.setter
    def live_range(self, value: tuple[int, int]) -> None:
        self._live_range, self._live_counts_stale, self._live_added = value, False, 0

    def _add_live(self, new: int) -> None:
        """Count ``new`` more live entries in every row (a pass appended or filled a slot in each): added to the
        counts when they are next read, as decoding steps between evictions read none."""
        self._live_added += new

    def _count_live_again(self) -> None:
        """Outside a compiled step, count the live entries again after compiled steps left the counts stale; add the
        entries counted since the counts were last read."""
        if self._live_counts_stale and not torch.compiler.is_compiling():
            self._live_counts_stale = False
            self._recount()
        elif self._live_added:
            added, self._live_added = self._live_added, 0
            self._live_by_group = {group: live + added for group, live in self._live_by_group.items()}
            least, most = self._live_range
            self._live_range = (least + added, most + added)
