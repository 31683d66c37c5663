"""The prompts and the reference text an evaluation runs on: decodekit's own, or local files read with datasets."""

from __future__ import annotations

from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).parent / "data" / "prompts.jsonl"
FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text", ".text": "text"}


def _load(path: str | Path, what: str):
    import datasets

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} file not found: {path}")
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{what} file must end in {', '.join(sorted(FORMATS))}; got {path.name}")
    datasets.disable_progress_bars()
    return datasets.load_dataset(kind, data_files=str(path), split="train")


def load_prompts(path: str | Path | None = None, column: str | None = None) -> list[str]:
    """Prompts from a local json/jsonl/csv/text file (column ``column``, default "prompt"; "text" for .txt),
    or decodekit's own prompt set when ``path`` is None.

    Example:
        >>> len(load_prompts()) >= 20
        True
    """
    table = _load(path or DEFAULT_PROMPTS, "prompts")
    column = column or ("text" if "text" in table.column_names and "prompt" not in table.column_names else "prompt")
    if column not in table.column_names:
        raise ValueError(f"the prompts file has no column {column!r}; its columns: {', '.join(table.column_names)}")
    prompts = [text.strip() for text in table[column] if isinstance(text, str) and text.strip()]
    if not prompts:
        raise ValueError(f"the prompts file has no non-empty text in column {column!r}")
    return prompts


def load_reference(path: str | Path | None = None) -> str:
    """A long real text: a local text file's content, or by default the standard library's
    documentation of the data model (``pydoc_data.topics``), which needs no download.

    Example:
        >>> len(load_reference()) > 20000
        True
    """
    if path is None:
        from pydoc_data.topics import topics

        return topics["specialnames"] + "\n\n" + topics["compound"]
    text = "\n".join(line for line in _load(path, "reference")["text"] if line is not None)
    if not text.strip():
        raise ValueError(f"the reference file {path} is empty")
    return text
