"""The prompts and the reference text an evaluation runs on: decodekit's own, or local files read with datasets."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).parent / "data" / "prompts.jsonl"
FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text", ".text": "text"}


class DataFileError(ValueError):
    """A prompts or reference file that cannot be read; the message names the file and the line."""


def _load(path: str | Path, what: str):
    import datasets

    path = Path(path)
    if not path.is_file():
        raise DataFileError(f"{what} file not found: {path}")
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise DataFileError(f"{what} file must end in {', '.join(sorted(FORMATS))}; got {path.name}")
    check_data_file(path, what)
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as error:  # datasets wraps parser errors in many types; say which file failed
        cause = error.__cause__ or error
        raise DataFileError(f"{what} file {path} could not be read as {kind}: {cause}") from None


def check_data_file(path: Path, what: str = "prompts") -> None:
    """Raise DataFileError naming ``path`` (and the line) if it is empty, not UTF-8 or not valid JSON.

    datasets reads the file afterwards; these checks only turn its failures into one-line messages.
    """
    data = path.read_bytes()
    if not data.strip():
        raise DataFileError(f"{what} file {path} is empty: expected {_EXPECTED[path.suffix.lower()]}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise DataFileError(
            f"{path} line {line}: byte 0x{data[error.start]:02x} is not UTF-8 text; save the file as UTF-8"
        ) from None
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                _check_json_object(line, path, number)
    elif suffix == ".json":
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataFileError(f"{path} line {error.lineno}: not valid JSON ({error.msg})") from None
        if not isinstance(document, (list, dict)) or not document:
            raise DataFileError(f"{path}: expected {_EXPECTED['.json']}")
    elif suffix == ".csv":
        rows = [row for row in csv.reader(io.StringIO(text)) if any(cell.strip() for cell in row)]
        if len(rows) < 2:
            raise DataFileError(f"{path} has a header line but no rows: expected {_EXPECTED['.csv']}")


def _check_json_object(line: str, path: Path, number: int) -> None:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataFileError(
            f"{path} line {number}: not valid JSON ({error.msg}); expected {_EXPECTED['.jsonl']}"
        ) from None
    if not isinstance(value, dict):
        raise DataFileError(f"{path} line {number}: expected {_EXPECTED['.jsonl']}; got {type(value).__name__}")


_EXPECTED = {
    ".jsonl": 'one JSON object per line, like {"prompt": "..."}',
    ".json": 'a JSON list of objects, like [{"prompt": "..."}]',
    ".csv": "a header line with a prompt column, then one row per prompt",
    ".txt": "one prompt per line",
    ".text": "one prompt per line",
}


def load_prompts(path: str | Path | None = None, column: str | None = None) -> list[str]:
    """Prompts from a local json/jsonl/csv/text file (column ``column``, default "prompt"; "text" for .txt),
    or decodekit's own prompt set when ``path`` is None.

    Example:
        >>> len(load_prompts()) >= 20
        True
    """
    path = Path(path or DEFAULT_PROMPTS)
    table = _load(path, "prompts")
    column = column or ("text" if "text" in table.column_names and "prompt" not in table.column_names else "prompt")
    if column not in table.column_names:
        raise DataFileError(
            f"the prompts file {path} has no column {column!r}; its columns: {', '.join(table.column_names)}"
        )
    prompts = [text.strip() for text in table[column] if isinstance(text, str) and text.strip()]
    if not prompts:
        raise DataFileError(f"the prompts file {path} has no non-empty text in column {column!r}")
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
        raise DataFileError(f"the reference file {path} is empty")
    return text
