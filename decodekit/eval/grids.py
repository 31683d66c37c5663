"""A researcher's own grid of recipes: rows read from a file, sweeps crossed with a base recipe, presets.

A row is a mapping: an optional ``label`` (the name reports, intervals and plots show; derived from the
fields when omitted), an optional ``preset`` (one of :func:`presets`, whose fields the row's own
override), an optional ``do_sample``, and any fields of the field table (``decodekit.fields``). Every
row becomes a validated :class:`~decodekit.strategies.Strategy` before any model loads, and a bad row
is refused with its number, its line in the file, the field and what the field accepts.

Example:
    >>> rows = [{"label": "mine", "preset": "min-p 0.1", "temperature": 0.7}, {"min_k": 1.0, "temperature": 1.5}]
    >>> [s.label for s in strategies_from_rows(rows)]
    ['mine', 'sample(temperature=1.5, min_k=1.0)']
    >>> [s.label for s in sweep_strategies([{"top_k": 0}], [parse_sweep("min_p=0.05,0.1")])]
    ['sample(min_p=0.05)', 'sample(min_p=0.1)']
"""

from __future__ import annotations

import csv
import difflib
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from decodekit.fields import BY_NAME, Field
from decodekit.strategies import Strategy

ROW_KEYS = ("label", "preset", "do_sample")
SUFFIXES = (".json", ".jsonl", ".yaml", ".yml", ".csv")

# The samplers of ``decodekit eval --grid samplers``, each at its usual setting (fields of a Strategy).
SAMPLERS: dict[str, dict[str, Any]] = {
    "top-p 0.9": {"top_p": 0.9},
    "min-p 0.1": {"min_p": 0.1},
    "top-n-sigma 1.0": {"top_n_sigma": 1.0},
    "Top-H 0.4": {"top_h": 0.4},
    "typical 0.9": {"typical_p": 0.9},
    "epsilon 3e-4": {"epsilon_cutoff": 3e-4},
    "eta 3e-4": {"eta_cutoff": 3e-4},
    "p-less": {"p_less": 2.0},
    "min-k": {"min_k": 1.0},
    "XTC 0.1/0.5": {"xtc_threshold": 0.1, "xtc_probability": 0.5},
    "mirostat 5/0.1": {"mirostat_tau": 5.0, "mirostat_eta": 0.1},
    "DRY 0.8": {"dry_multiplier": 0.8},
    "adaptive-p 0.4": {"min_p": 0.05, "adaptive_p": 0.4},
}


def presets() -> dict[str, dict[str, Any]]:
    """The recipes a row can name: ``greedy``, every sampler of the sampler grid at its usual setting (at
    temperature 1 unless the row sets one), and the default grid's recipes by their names.

    Example:
        >>> presets()["min-k"], presets()["beam 4, gnmt"]["length_normalization"]
        ({'min_k': 1.0}, 'gnmt')
    """
    named = {"greedy": {}, **{name: dict(fields) for name, fields in SAMPLERS.items()}}
    for strategy in default_strategies():
        named.setdefault(strategy.name, {key: value for key, value in strategy.to_dict().items() if key != "name"})
    return named


def _describe(where: str, message: str) -> ValueError:
    return ValueError(f"{where}: {message}")


def _value(field: Field, value: Any) -> Any:
    """A row's value for ``field``: text is parsed as on the command line, the field's ``off`` value unsets it."""
    if isinstance(value, str) and field.kind not in ("text", "choice"):
        return field.parse(value.strip())
    if isinstance(value, str) and field.kind == "choice":
        return field.parse(value.strip())
    if field.off is not None and not isinstance(value, bool) and value == field.off:
        return None
    return value


def strategy_from_row(row: Any, where: str = "row 1", named: Mapping[str, Mapping[str, Any]] | None = None) -> Strategy:
    """One row as a validated Strategy, or a ValueError that starts with ``where`` and names the field.

    Example:
        >>> strategy_from_row({"label": "cool", "preset": "top-p 0.9", "temperature": 0.7}).to_dict()
        {'name': 'cool', 'temperature': 0.7, 'top_p': 0.9}
        >>> strategy_from_row({"top_q": 0.9}, "row 3 (line 4)")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: row 3 (line 4): unknown field 'top_q' (did you mean top_p?); a row takes label, preset, ...
    """
    if isinstance(row, Strategy):
        return row
    if not isinstance(row, Mapping):
        raise _describe(where, f'expected a mapping of fields, like {{"label": ..., "top_p": 0.9}}; got {row!r}')
    unknown = [key for key in row if key not in ROW_KEYS and key not in BY_NAME]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), [*ROW_KEYS, *BY_NAME], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise _describe(
            where, f"unknown field {unknown[0]!r}{hint}; a row takes label, preset, do_sample and the fields of the "
            "field table (decodekit eval --help lists them)",
        )  # fmt: skip
    label = row.get("label")
    if label is not None and (not isinstance(label, str) or not label.strip()):
        raise _describe(where, f"label must be a non-empty string; got {label!r}")
    fields: dict[str, Any] = {}
    preset = row.get("preset")
    if preset is not None:
        named = presets() if named is None else named
        if preset not in named:
            raise _describe(where, f"unknown preset {preset!r}; presets: {', '.join(named)}")
        fields.update(named[preset])
    for key, value in row.items():
        if key in BY_NAME and value is not None and value != "":
            try:
                fields[key] = _value(BY_NAME[key], value)
            except ValueError as error:
                raise _describe(where, f"{key} {error}") from None
    do_sample = row.get("do_sample")
    if isinstance(do_sample, str):
        do_sample = {"true": True, "false": False, "": None}.get(do_sample.strip().lower(), do_sample)
    name = label.strip() if label else (preset if preset is not None and fields == dict(named[preset]) else None)
    try:
        return Strategy(name=name, do_sample=do_sample, **{k: v for k, v in fields.items() if v is not None})
    except (TypeError, ValueError) as error:
        raise _describe(where, str(error)) from None


def strategies_from_rows(rows: Iterable[Any], wheres: Sequence[str] | None = None) -> list[Strategy]:
    """Every row as a Strategy (rows may already be Strategies), refusing the first bad row and repeated
    labels; ``wheres`` names each row in messages (``row N`` by default).

    Example:
        >>> strategies_from_rows([{"label": "a"}, {"label": "a", "top_p": 0.9}])
        Traceback (most recent call last):
        ...
        ValueError: row 2: label 'a' is row 1's too; each row needs its own label
    """
    rows = list(rows)
    wheres = list(wheres) if wheres is not None else [f"row {number}" for number in range(1, len(rows) + 1)]
    named = presets()
    strategies = [strategy_from_row(row, where, named) for row, where in zip(rows, wheres, strict=True)]
    seen: dict[str, str] = {}
    for strategy, where in zip(strategies, wheres, strict=True):
        first = seen.setdefault(strategy.label, where)
        if first != where:
            row = first.split(" (")[0]
            raise _describe(where, f"label {strategy.label!r} is {row}'s too; each row needs its own label")
    if not strategies:
        raise ValueError("the grid has no rows")
    return strategies


def read_rows(path: str | Path) -> tuple[list[Any], list[str]]:
    """The rows of a JSON (a list of objects), JSONL, YAML (a list of mappings) or CSV file (a header of
    field names; empty cells are unset), with where each row is (``row N (line L)``).

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "grid.csv")
        >>> _ = open(path, "w").write("label,min_p,temperature\\nlow,0.02,1.0\\nhigh,0.1,\\n")
        >>> rows, wheres = read_rows(path)
        >>> rows[1], wheres  # an empty cell leaves its field unset
        ({'label': 'high', 'min_p': '0.1'}, ['row 1 (line 2)', 'row 2 (line 3)'])
    """
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise ValueError(f"--strategies {path}: the file must end in {', '.join(SUFFIXES)}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"--strategies {path}: cannot read it ({error.strerror or error})") from None
    suffix = path.suffix.lower()
    if suffix == ".json":
        rows, lines = _json_rows(path, text)
    elif suffix == ".jsonl":
        rows, lines = _jsonl_rows(path, text)
    elif suffix == ".csv":
        rows, lines = _csv_rows(text)
    else:
        rows, lines = _yaml_rows(path, text)
    if not rows:
        raise ValueError(f"--strategies {path}: the file has no rows")
    return rows, [f"row {number} (line {line})" for number, line in enumerate(lines, start=1)]


def _json_rows(path: Path, text: str) -> tuple[list[Any], list[int]]:
    """The elements of a top-level JSON list, each with the line it starts on."""
    decoder = json.JSONDecoder()
    position = _skip_space(text, 0)
    if not text.startswith("[", position):
        raise ValueError(f"--strategies {path}: a JSON grid is a list of rows, [{{...}}, {{...}}]")
    rows, lines = [], []
    position = _skip_space(text, position + 1)
    while not text.startswith("]", position):
        try:
            row, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            raise ValueError(f"--strategies {path}: line {error.lineno}: {error.msg}") from None
        rows.append(row)
        lines.append(text.count("\n", 0, position) + 1)
        position = _skip_space(text, end)
        if text.startswith(",", position):
            position = _skip_space(text, position + 1)
        elif not text.startswith("]", position):
            line = text.count("\n", 0, position) + 1
            raise ValueError(f"--strategies {path}: line {line}: expected ',' or ']' after a row")
    return rows, lines


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _jsonl_rows(path: Path, text: str) -> tuple[list[Any], list[int]]:
    rows, lines = [], []
    for line, content in enumerate(text.splitlines(), start=1):
        if not content.strip():
            continue
        try:
            rows.append(json.loads(content))
        except json.JSONDecodeError as error:
            raise ValueError(f"--strategies {path}: line {line}: {error.msg}") from None
        lines.append(line)
    return rows, lines


def _csv_rows(text: str) -> tuple[list[Any], list[int]]:
    reader = csv.DictReader(text.splitlines())
    rows, lines = [], []
    for row in reader:
        if not any((value or "").strip() for value in row.values()):
            continue
        extra = row.pop(None, None)
        if extra:
            row[f"(a cell past the header's {len(reader.fieldnames or [])} columns)"] = extra
        rows.append({key.strip(): value.strip() for key, value in row.items() if value and value.strip()})
        lines.append(reader.line_num)
    return rows, lines


def _yaml_rows(path: Path, text: str) -> tuple[list[Any], list[int]]:
    import yaml

    try:
        document = yaml.compose(text, Loader=yaml.SafeLoader)
        rows = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise ValueError(f"--strategies {path}: {where}{getattr(error, 'problem', None) or error}") from None
    if not isinstance(rows, list) or document is None:
        raise ValueError(f"--strategies {path}: a YAML grid is a list of rows (each line starting with '- ')")
    return rows, [node.start_mark.line + 1 for node in document.value]


def read_strategies(path: str | Path) -> list[Strategy]:
    """The validated rows of a grid file (see :func:`read_rows`), refused at the first bad row.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "grid.jsonl")
        >>> _ = open(path, "w").write('{"label": "a", "min_p": 0.05}\\n{"label": "b", "min_p": 2}\\n')
        >>> read_strategies(path)
        Traceback (most recent call last):
        ...
        ValueError: row 2 (line 2): min_p must be a number in [0, 1]; got 2
    """
    rows, wheres = read_rows(path)
    return strategies_from_rows(rows, wheres)


def parse_sweep(text: str) -> tuple[str, tuple[Any, ...]]:
    """``FIELD=V1,V2,...`` as (field name, values), each value checked as its flag checks it (a text field's
    values are separated by ``;``, since its values hold commas).

    Example:
        >>> parse_sweep("min-p=0.02,0.05"), parse_sweep("top_k=0,40")
        (('min_p', (0.02, 0.05)), ('top_k', (None, 40)))
        >>> parse_sweep("min_p=0.02,x")
        Traceback (most recent call last):
        ...
        ValueError: --sweep min_p=0.02,x: min_p expected a number, got 'x'
    """
    name, separator, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if not separator or not values.strip():
        raise ValueError(f"--sweep {text}: write FIELD=V1,V2,..., e.g. --sweep min_p=0.02,0.05,0.1")
    if name not in BY_NAME:
        close = difflib.get_close_matches(name, list(BY_NAME), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"--sweep {text}: unknown field {name!r}{hint}; decodekit eval --help lists the fields")
    field = BY_NAME[name]
    if field.kind == "texts":
        raise ValueError(f"--sweep {text}: {name} takes a list and cannot be swept; give one row per value in a file")
    parts = values.split(";") if field.kind == "text" else values.split(",")
    try:
        parsed = tuple(field.parse(part.strip()) for part in parts)
    except ValueError as error:
        raise ValueError(f"--sweep {text}: {name} {error}") from None
    if len(set(parsed)) != len(parsed):
        raise ValueError(f"--sweep {text}: {name} has a value twice")
    return name, parsed


def sweep_strategies(bases: Sequence[Any], sweeps: Sequence[tuple[str, Sequence[Any]]]) -> list[Strategy]:
    """Every base recipe crossed with every combination of the swept values (the last sweep varying
    fastest); a swept field replaces the base's own value. A named base keeps its name, followed by the
    swept values; others are labelled by their fields.

    Example:
        >>> grid = sweep_strategies([{}], [("min_p", (0.05, 0.1)), ("temperature", (0.7, 1.0, 1.5))])
        >>> len(grid), grid[0].label, grid[-1].label
        (6, 'sample(temperature=0.7, min_p=0.05)', 'sample(temperature=1.5, min_p=0.1)')
        >>> sweep_strategies([{"label": "mine", "top_p": 0.9}], [("temperature", (0.7,))])[0].label
        'mine, temperature=0.7'
    """
    names = [name for name, _ in sweeps]
    if len(set(names)) != len(names):
        raise ValueError(f"--sweep: {names[0]} is swept twice; give its values once, comma-separated")
    combinations = list(itertools.product(*(values for _, values in sweeps)))
    base_strategies = strategies_from_rows(bases) if bases else [Strategy()]
    grid = []
    for base in base_strategies:
        fields = {key: value for key, value in base.to_dict().items() if key not in ("name", "do_sample")}
        for values in combinations:
            swept = dict(zip(names, values, strict=True))
            recipe = {key: value for key, value in {**fields, **swept}.items() if value is not None}
            shown = ", ".join(f"{name}={_shown(value)}" for name, value in swept.items())
            name = f"{base.name}, {shown}" if base.name and shown else base.name
            where = f"--sweep {shown}" + (f" on {base.name}" if base.name else "")
            try:
                grid.append(Strategy(name=name, do_sample=base.do_sample, **recipe))
            except (TypeError, ValueError) as error:
                raise ValueError(f"{where}: {error}") from None
    return strategies_from_rows(grid)


def _shown(value: Any) -> str:
    return "off" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def as_strategies(strategies: Any) -> list[Strategy]:
    """What ``evaluate_strategies`` takes: Strategies, rows (mappings) or a grid file's path.

    Example:
        >>> [s.label for s in as_strategies([{"label": "x", "top_h": 0.4}])]
        ['x']
    """
    if isinstance(strategies, (str, Path)):
        return read_strategies(strategies)
    return strategies_from_rows(strategies)


def default_strategies() -> list[Strategy]:
    """The grid a plain ``decodekit eval`` compares: greedy, top-p and min-p across temperatures,
    top-n-sigma, XTC, Mirostat and DRY at T=1.0 and 1.5, the staged penalty, beam search with
    each normalization, and the compressed cache."""
    grid = [Strategy(name="greedy")]
    for temperature in (0.7, 1.0, 1.3, 1.5):
        grid.append(Strategy(name=f"top-p 0.9, T={temperature}", temperature=temperature, top_p=0.9))
        grid.append(Strategy(name=f"min-p 0.1, T={temperature}", temperature=temperature, min_p=0.1))
    for temperature in (1.0, 1.5):  # the llama.cpp samplers, at the temperatures where they matter
        grid.append(Strategy(name=f"top-n-sigma 1.0, T={temperature}", temperature=temperature, top_n_sigma=1.0))
        grid.append(Strategy(name=f"XTC 0.1/0.5, T={temperature}", temperature=temperature, xtc_threshold=0.1,
                             xtc_probability=0.5))  # fmt: skip
        grid.append(Strategy(name=f"mirostat 5/0.1, T={temperature}", temperature=temperature, mirostat_tau=5.0,
                             mirostat_eta=0.1))  # fmt: skip
        grid.append(Strategy(name=f"DRY 0.8, T={temperature}", temperature=temperature, dry_multiplier=0.8))
    grid.append(Strategy(name="greedy, staged penalty", staged_penalty="1:1.2,3:1.5,6:2.0", penalty_window=64))
    for normalization in ("none", "average", "gnmt"):
        alpha = None if normalization == "none" else (1.0 if normalization == "average" else 0.6)
        grid.append(
            Strategy(
                name=f"beam 4, {normalization}", num_beams=4, length_normalization=normalization, length_alpha=alpha
            )
        )
    grid.append(Strategy(name="greedy, kv budget 64", kv_budget=64))
    return grid


def sampler_grid(temperatures: Sequence[float] = (1.0, 1.5)) -> list[Strategy]:
    """Every sampler of ``SAMPLERS`` at every temperature (named "<sampler>, T=<t>"), for
    ``decodekit eval --grid samplers``; several temperatures make ``temperature.png`` a sweep.

    Example:
        >>> [s.label for s in sampler_grid([0.7])][:2]
        ['top-p 0.9, T=0.7', 'min-p 0.1, T=0.7']
    """
    return [
        Strategy(name=f"{name}, T={temperature:g}", temperature=temperature, **fields)
        for temperature in temperatures
        for name, fields in SAMPLERS.items()
    ]
