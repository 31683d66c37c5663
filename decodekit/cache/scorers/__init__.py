"""How a compressed cache ranks its entries: one file per scorer, named in ``settings.KV_SCORERS``.

A scorer is made for each layer and answers: ``fields`` (what the storage keeps per entry for it), ``new_entries``
(those fields for a pass's new tokens), ``after_pass`` (score a pass, or queue it for the next eviction) with
``flush`` (score what is queued), and ``importance`` (what eviction ranks by, before the sinks and the recent window
are protected). A scorer whose ``replays`` is True is also called once the prompt has passed (``after_prompt``). A
new scorer is its file and one row of ``settings.KV_SCORERS``.
"""

from __future__ import annotations

from importlib import import_module

from decodekit.settings import KV_SCORERS


def _load(path: str) -> type:
    module, name = path.split(":")
    return getattr(import_module(module), name)


SCORERS: dict[str, type] = {name: _load(path) for name, path in KV_SCORERS.items()}

__all__ = ["SCORERS"]
