"""One attention layer whose KV heads keep different numbers of tokens (``allocation="heads"``).

Each KV head of the layer is stored apart, as a one-head :class:`CompressedLayer` (a *unit*) that holds
only the tokens its head keeps, so the memory a head's tokens take is freed when they go. One ranking of
the reconstruction scores over every (layer, KV head) decides how many each unit keeps, as KVzip
allocates. Attention reads the layer's heads side by side, each padded to the longest with entries the
mask hides: that dense copy exists for one layer's attention call at a time and is not kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicLayer

from decodekit.cache.layer import CompressedLayer
from decodekit.cache.policy import EvictionPolicy
from decodekit.cache.storage import CODING, PARTS, decoded_part, storage_bytes, write_slots


class HeadsLayer(DynamicLayer):
    """A cache layer made of one :class:`CompressedLayer` per KV head, each of its own length.

    It answers the observer and transformers as a ``CompressedLayer`` does (``begin_pass``,
    ``observe``, ``update``, ``compress``, masks, beams, crop) by passing each call to its units,
    with each head's share of the keys, values and query columns.
    """

    is_croppable = True
    supports_early_init = False

    def __init__(self, policy: EvictionPolicy, kv_heads: int, *, matched: bool = False) -> None:
        super().__init__()
        self.policy = policy
        self.units = [CompressedLayer(policy, matched=matched) for _ in range(kv_heads)]
        self._lengths: list[int] = []  # each unit's keys in the coming pass (its ``get_mask_sizes``)
        # The coming pass's visibility, ``[batch, kv_heads, queries, longest]`` (None: everything stored), and its
        # observed query columns for every head: what scoring all heads at once needs.
        self._visible: torch.Tensor | None = None
        self._columns: torch.Tensor | None = None
        # In a decoding step made for all heads at once (``_begin_step``): the slot each row and head's new token
        # takes, ``[batch, kv_heads]`` (a free slot, or the column after its stored entries).
        self._step_slots: torch.Tensor | None = None

    # -- what the units share ------------------------------------------------------------------------

    @property
    def seen(self) -> int:
        return self.units[0].seen

    @property
    def slots(self) -> int:
        """The most entries any head stores (the width of the dense copy attention reads)."""
        return max(unit.slots for unit in self.units)

    @property
    def kept(self) -> int:
        """The most tokens any row keeps in any head."""
        return max(unit.kept for unit in self.units)

    def get_seq_length(self) -> int:
        return self.units[0].get_seq_length()

    @property
    def reads_turned_keys(self) -> bool:
        """Whether attention reads the heads' coded keys turned (see ``CompressedLayer.reads_turned_keys``)."""
        return self.units[0].reads_turned_keys

    @reads_turned_keys.setter
    def reads_turned_keys(self, turned: bool) -> None:
        for unit in self.units:
            unit.reads_turned_keys = turned

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(unit.get_mask_sizes(query_length)[0] for unit in self.units), 0

    # -- a forward pass ------------------------------------------------------------------------------

    def begin_pass(
        self,
        query_length: int,
        pads: torch.Tensor | None = None,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor | None:
        """Prepare every head for a pass of ``query_length`` tokens; return the layer's attention mask
        ``[batch, kv_heads, query_length, keys]`` (None when the model's own mask is right)."""
        first_pass = not self.is_initialized
        self._step_slots = None
        if first_pass:
            masks = [unit.begin_pass(query_length, pads, sliding_window=sliding_window, softcap=softcap)
                     for unit in self.units]  # fmt: skip
        elif query_length == 1 and self.units[0].sliding_window is None:
            return self._begin_step()
        else:
            masks = [unit.begin_pass(query_length) for unit in self.units]
        self._lengths = [unit.get_mask_sizes(query_length)[0] for unit in self.units]
        self._visible = None if first_pass else self._layer_mask(query_length, masks)
        return self._visible

    def _begin_step(self) -> torch.Tensor | None:
        """``begin_pass`` for a decoding step of a layer without a sliding window, with the mask made for all heads at
        once: each head sees its live entries and its new token's slot (``CompressedLayer.pass_mask``)."""
        for unit in self.units:
            unit.begin_pass(1, mask=False)
        self._lengths = [unit.get_mask_sizes(1)[0] for unit in self.units]
        batch = self.units[0].live.shape[0]
        slots = [unit.live.new_full((batch, 1), unit.slots, dtype=torch.long) if unit._free is None else unit._free
                 for unit in self.units]  # fmt: skip
        self._step_slots = torch.cat(slots, dim=1)
        if len(set(self._lengths)) == 1 and not any(unit.needs_mask(1) for unit in self.units):
            self._visible = None
        else:
            visible = side_by_side([unit.live for unit in self.units], max(self._lengths), fill=False)
            self._visible = visible.scatter_(2, self._step_slots[..., None], True)[:, :, None, :]
        return self._visible

    @property
    def biased(self) -> bool:
        """Whether any head's prompt entries were refit with biases (``CompressedLayer.biased``)."""
        return any(unit.biased for unit in self.units)

    def biased_mask(self, query_length: int, visible: torch.Tensor | None) -> torch.Tensor:
        """The heads' biased masks side by side (see ``CompressedLayer.biased_mask``)."""
        if visible is None:
            visible = self.pass_mask(query_length, plain=True)
        return torch.where(visible, self._bias_rows(visible.shape[-1]), -math.inf)

    def _bias_rows(self, columns: int) -> torch.Tensor:
        """The heads' ``bias_row`` side by side: ``[batch, kv_heads, 1, columns]``."""
        return torch.cat([unit.bias_row(columns) for unit in self.units], dim=1)

    def pass_mask(self, query_length: int, *, plain: bool = False) -> torch.Tensor | None:
        """The layer's mask for the coming pass (see ``CompressedLayer.pass_mask``)."""
        if not self.is_initialized:
            return None
        return self._layer_mask(query_length, [unit.pass_mask(query_length, plain=plain) for unit in self.units])

    def _layer_mask(self, query_length: int, masks: list[torch.Tensor | None]) -> torch.Tensor | None:
        """None when every head has the same length and needs no mask of its own, else the heads' masks side by side."""
        if len(set(self._lengths)) == 1 and all(mask is None for mask in masks):
            return None
        return self._side_by_side(query_length, masks)

    def _side_by_side(self, query_length: int, masks: list[torch.Tensor | None]) -> torch.Tensor:
        """The heads' masks side by side, each extended with hidden entries to the longest head's length."""
        longest = max(self._lengths)
        parts = []
        for unit, mask, length in zip(self.units, masks, self._lengths, strict=True):
            if mask is None:
                mask = unit.pass_mask(query_length, plain=True)
            if length < longest:
                hidden = mask.new_zeros((*mask.shape[:-1], longest - length))
                mask = torch.cat([mask, hidden], dim=-1)
            parts.append(mask)
        return torch.cat(parts, dim=1)

    def observe(
        self,
        columns: torch.Tensor,
        to_queries: Callable[[torch.Tensor], torch.Tensor],
        scaling: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Give each head the query columns of the query heads that share it (they are grouped in order)."""
        self._columns = columns
        width = columns.shape[-1] // len(self.units)
        for index, unit in enumerate(self.units):
            unit.observe(columns[..., index * width : (index + 1) * width], to_queries, scaling, cos, sin)

    def weigh_replay(self, inverse_hidden_norms: torch.Tensor, output_grams: torch.Tensor) -> None:
        """Give each head the replay weights of the query heads that share it."""
        group = output_grams.shape[0] // len(self.units)
        for index, unit in enumerate(self.units):
            unit.weigh_replay(inverse_hidden_norms, output_grams[index * group : (index + 1) * group])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store each head's keys and values in its unit; return the heads side by side for attention.

        After the first pass, quantized entries are coded for every head at once (each entry is coded on its own,
        so this is what each unit would store) and decoded for every head at once, straight into the side-by-side
        layout, which is the one dense copy of the layer; a decoding step's token is scored for every head at once
        where no head's scoring waits (``_score_step_together``)."""
        if not (self.is_initialized and self.units[0].quantized):
            return self._update_apart(key_states, value_states)
        coded, read_keys = self.units[0]._code(key_states, value_states)
        heads = {name: entry.split(1, dim=1) for name, entry in coded.items()}  # each head's own views
        states = zip(*(part.split(1, dim=1) for part in (key_states, value_states, read_keys)), strict=True)
        for index, (unit, (own_keys, own_values, own_read_keys)) in enumerate(zip(self.units, states, strict=True)):
            own = {name: pieces[index] for name, pieces in heads.items()}
            done = unit.store(own_keys, own_values, coded=own, read_keys=own_read_keys)
            assert not done, "a quantized unit never reads its stored tensors as they are"
        keys, values = self._decoded_side_by_side()
        ring = self.units[0].recent_keys.shape[2]  # exact recent entries (none with residual_length=0)
        own_parts = None  # each head's entries in the side-by-side copy, made only where some unit needs its own
        if ring or self._step_slots is None:
            own_parts = self._own_parts(keys, values)
        if ring:
            for unit, (unit_keys, unit_values) in zip(self.units, own_parts, strict=True):
                unit.write_ring(unit_keys, unit_values)
        if self._step_slots is not None:  # the step's own keys and values, exact, for every head at once
            write_slots(keys, self._step_slots[..., None], read_keys.to(keys.dtype))
            write_slots(values, self._step_slots[..., None], value_states.to(values.dtype))
        else:
            for unit, (unit_keys, unit_values) in zip(self.units, own_parts, strict=True):
                unit.write_pass_exact(unit_keys, unit_values)
        if not self._score_step_together(keys):
            for unit, (unit_keys, unit_values) in zip(
                self.units, own_parts or self._own_parts(keys, values), strict=True
            ):
                unit.finish_pass(unit_keys, unit_values)
        self._columns = self._visible = self._step_slots = None
        return keys, values

    def _own_parts(self, keys: torch.Tensor, values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each unit's own entries in the side-by-side ``keys`` and ``values``: views of its head and stored slots."""
        return [
            (keys[:, index : index + 1, : unit.slots], values[:, index : index + 1, : unit.slots])
            for index, unit in enumerate(self.units)
        ]

    def _score_step_together(self, keys: torch.Tensor) -> bool:
        """Score a decoding step's one token for every head at once, as each unit's ``finish_pass`` would: the mean,
        over the query heads sharing a KV head, of each query's attention (a softmax over what the pass's mask lets
        it see). False, with nothing done, when some unit scores otherwise (waiting, replaying, a sliding window,
        a softcap, pooled scores)."""
        first = self.units[0]
        if self._columns is None or self._columns.shape[1] != 1 or first.softcap is not None:
            return False
        if first.policy.pool_kernel != 1 or first.sliding_window is not None or first.replaying:
            return False
        passes = [unit._stored_pass for unit in self.units]
        if any(stored is None or stored.deferred for stored in passes) or first.awaits_replay_alone:
            return False
        stored = passes[0]
        queries = first._rotated_queries(self._columns, stored.cos, stored.sin)  # [batch, heads, 1, head_dim]
        batch, kv_heads, _, head_dim = keys.shape
        grouped = (queries.float() * stored.scaling).reshape(batch, kv_heads, -1, head_dim)
        logits = torch.matmul(grouped, keys.float().transpose(-1, -2))  # [batch, kv_heads, group, longest]
        if self.biased:
            logits += self._bias_rows(logits.shape[-1])
        if self._visible is not None:
            logits.masked_fill_(~self._visible, -math.inf)
        received = logits.softmax(dim=-1).mean(dim=2)
        for index, unit in enumerate(self.units):
            unit._stored_pass = None
            unit.scores.add_(received[:, index : index + 1, : unit.slots])
        return True

    def _update_apart(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """``update`` one unit at a time (the first pass, and entries stored as they are)."""
        self._columns = self._visible = self._step_slots = None  # each unit scores its own pass
        parts = [
            unit.update(key_states[:, index : index + 1], value_states[:, index : index + 1])
            for index, unit in enumerate(self.units)
        ]
        self.is_initialized = True
        longest = max(keys.shape[2] for keys, _ in parts)
        keys, values = (side_by_side(list(part), longest) for part in zip(*parts, strict=True))
        return keys, values

    def _decoded_side_by_side(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every unit's stored keys and values decoded to the cache's dtype, side by side in ``[batch, kv_heads,
        longest, head_dim]``: the heads' codes, scales and offsets are put side by side (past a unit's own entries,
        zeros, which decode to zeros that the mask hides) and decoded at once."""
        first = self.units[0]
        longest = max(unit.slots for unit in self.units)
        decoded = []
        for part in PARTS:
            quantizer, turned = first.quantizers[part], part == "keys" and first.reads_turned_keys
            names = (part,) if quantizer is None else (part, *(name for name in CODING if name.startswith(part[:-1])))
            stored = {name: side_by_side([getattr(unit, name) for unit in self.units], longest) for name in names}
            decoded.append(decoded_part(part, quantizer, stored.__getitem__, first.dtype, turned=turned))
        keys, values = decoded
        return keys, values

    def compress(self, new: int) -> None:
        for unit in self.units:
            unit.compress(new)

    # -- rows, crop, size ------------------------------------------------------------------------------

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for unit in self.units:
            unit.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for unit in self.units:
            unit.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for unit in self.units:
            unit.batch_select_indices(indices)

    def crop(self, tokens_to_remove: int) -> None:
        for unit in self.units:
            unit.crop(tokens_to_remove)

    def reset(self) -> None:
        for unit in self.units:
            unit.reset()
        self.is_initialized = False
        self._lengths = []
        self._columns = self._visible = self._step_slots = None

    def kept_positions(self) -> torch.Tensor:
        """The logical positions of the live tokens, ``[batch, kv_heads, kept]``, increasing; a head that
        keeps fewer is filled with -1 at the front."""
        positions = [unit.kept_positions() for unit in self.units]
        most = max(part.shape[-1] for part in positions)
        padded = [torch.nn.functional.pad(part, (most - part.shape[-1], 0), value=-1) for part in positions]
        return torch.cat(padded, dim=1)

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor the heads hold (see ``CompressedLayer.held_tensors``)."""
        return [tensor for unit in self.units for tensor in unit.held_tensors()]

    def memory_bytes(self) -> int:
        return sum(storage_bytes(self.held_tensors()).values())


def side_by_side(tensors: list[torch.Tensor], longest: int, fill: float | bool = 0) -> torch.Tensor:
    """One-head tensors ``[batch, 1, length_i, *trailing]`` side by side as ``[batch, heads, longest, *trailing]``,
    each extended with ``fill`` to ``longest`` entries, in one ``cat``.

    Example:
        >>> side_by_side([torch.tensor([[[1, 2]]]), torch.tensor([[[3]]])], 3).tolist()
        [[[1, 2, 0], [3, 0, 0]]]
    """
    first = tensors[0]
    batch, trailing = first.shape[0], first.shape[3:]
    shortest = min(tensor.shape[2] for tensor in tensors)
    filler = first.new_full((batch, 1, longest - shortest, *trailing), fill) if shortest < longest else None
    pieces = []
    for tensor in tensors:
        pieces.append(tensor)
        if tensor.shape[2] < longest:
            pieces.append(filler.narrow(2, 0, longest - tensor.shape[2]))
    return torch.cat(pieces, dim=2).view(batch, len(tensors), longest, *trailing)
