"""Where SFT rows come from: local JSONL / JSON / Parquet / CSV files or Hugging Face hub datasets.

JSON Lines and JSON files are read here, row by row, so that a malformed row is reported with its
file and line and a fix. Parquet, CSV and hub datasets are read through `datasets` (an optional
dependency, imported only for them: it brings pyarrow and pandas) and each row is checked right after,
rather than reported as a pyarrow error deep inside a loader.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

FILE_FORMATS = ("jsonl", "json", "parquet", "csv")
FORMATS = (*FILE_FORMATS, "hub")
# `data.format=preference`: rows of (prompt, chosen, rejected) for DPO, the file's format read from its
# extension (or a hub id), as with data.format=null.
PREFERENCE = "preference"
_EXTENSIONS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}
_BUILDERS = {"parquet": "parquet", "csv": "csv"}  # `datasets` builders of the file formats it reads
# The line that installs `datasets`, which Parquet, CSV and hub sources need.
DATASETS_INSTALL = "pip install -e '.[datasets]' -c constraints.txt"
_BOM = b"\xef\xbb\xbf"
# A hub dataset id: "org/name", nothing that looks like a relative path to a data file.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
ROLES = ("system", "user", "assistant")
TRAIN_ON = ("assistant", "last_assistant", "all")
CHAT_TEMPLATES = ("auto", "builtin", "nemotron3", "tokenizer")
REASONING_MODES = ("train", "answer_only", "drop")
# An assistant turn's reasoning beside its content, the key the released Nemotron 3 template reads.
REASONING_FIELD = "reasoning_content"
MAX_LENGTH_POLICIES = ("truncate", "drop")


class DataError(ValueError):
    """A data source is missing or malformed; the message says where and how to fix it."""


@dataclass(frozen=True)
class Columns:
    """Which columns a row must have: prompt/response text, or one column of chat turns."""

    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: Optional[str] = None
    role_key: str = "role"
    content_key: str = "content"

    @property
    def is_chat(self) -> bool:
        return self.messages_key is not None

    @property
    def required(self) -> tuple[str, ...]:
        return (self.messages_key,) if self.messages_key is not None else (self.prompt_key, self.response_key)

    @classmethod
    def from_config(cls, data_cfg: Any) -> "Columns":
        return cls(
            prompt_key=data_cfg.prompt_key,
            response_key=data_cfg.response_key,
            messages_key=getattr(data_cfg, "messages_key", None),
            role_key=getattr(data_cfg, "role_key", "role"),
            content_key=getattr(data_cfg, "content_key", "content"),
        )


@dataclass
class Rows:
    """Validated rows and how to name row `i` in an error message. `dataset`: the rows of a JSON Lines or
    JSON file as a list of dicts, or a `datasets.Dataset` for the formats `datasets` reads."""

    dataset: Any
    where: Callable[[int], str]

    def __len__(self) -> int:
        return len(self.dataset)

    def take(self, indices: list[int], keys: tuple[str, ...]) -> list[dict[str, Any]]:
        """The rows at `indices`, each with the columns `keys` only."""
        if isinstance(self.dataset, list):
            return [{k: self.dataset[i][k] for k in keys} for i in indices]
        batch = self.dataset.select_columns(list(keys))[indices]
        return [dict(zip(batch, values)) for values in zip(*batch.values())]

    def chunks(self, order: Sequence[int], keys: tuple[str, ...], size: int
               ) -> Iterator[tuple[list[int], list[dict[str, Any]], list[str]]]:
        """The rows at `order`, `size` at a time (a hub dataset is read column-wise per chunk), each chunk
        as (indices, rows with the columns `keys`, how to name each row in an error)."""
        order = list(order)
        for lo in range(0, len(order), size):
            indices = order[lo: lo + size]
            yield indices, self.take(indices, keys), [self.where(i) for i in indices]


# ------------------------------------------------------------------------------- resolving sources
def looks_like_hub_id(value: str) -> bool:
    return bool(_HUB_ID.match(value)) and Path(value).suffix.lower() not in _EXTENSIONS


def source_format(value: str, fmt: Optional[str]) -> str:
    """`fmt` when given, else the format a local path's extension names, else "hub" for a hub id."""
    if fmt and fmt != PREFERENCE:
        return fmt
    p = Path(value).expanduser()
    if p.exists() or not looks_like_hub_id(value):
        return _EXTENSIONS.get(p.suffix.lower(), "")
    return "hub"


def check_data_config(data_cfg: Any) -> list[str]:
    """Problems in the `data` settings that can be found without reading any data."""
    fmt, errors = _checked_format(data_cfg)
    for name in ("train_file", "val_file"):
        errors += _check_source(f"data.{name}", getattr(data_cfg, name), fmt)
    return errors + _check_val_split(data_cfg) + _check_choices(data_cfg) + _check_chat_template(data_cfg.chat_template)


def _checked_format(data_cfg: Any) -> tuple[str | None, list[str]]:
    """`data.format` as the sources read it (None: from each file's extension), and its problem."""
    fmt = None if data_cfg.format == PREFERENCE else data_cfg.format
    if fmt is None or fmt in FORMATS:
        return fmt, []
    return None, [f"data.format={fmt!r}: unknown format. Fix: use one of {[*FORMATS, PREFERENCE]}, or null to "
                  "infer it from the file extension."]


def _check_source(field_name: str, value: str | None, fmt: str | None) -> list[str]:
    """A data file (or hub dataset id) that exists and whose format is known."""
    if value is None:
        return ["data.train_file is null. Fix: point it at a data file or a hub dataset name."] \
            if field_name == "data.train_file" else []
    kind = source_format(value, fmt)
    p = Path(value).expanduser()
    if kind == "hub":
        if p.exists() or not _HUB_ID.match(value):
            return [f"{field_name}={value!r}: with data.format=hub it must be a hub dataset id like 'org/name'. "
                    "Fix: set data.format to the file's format, or null."]
        return []
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else "does not exist"
        return [f"{field_name}={value!r}: {what} (relative paths resolve against the launch directory). Fix: point "
                f"{field_name} at an existing .jsonl/.json/.parquet/.csv file, or at a Hugging Face hub dataset as "
                "'org/name'."]
    if not kind:
        return [f"{field_name}={value!r}: cannot tell the format from the extension {p.suffix!r}. Fix: set "
                f"data.format to one of {list(FILE_FORMATS)}."]
    return []


def _check_val_split(data_cfg: Any) -> list[str]:
    """At most one way of choosing the validation set, and a held-out share in [0, 1)."""
    fraction = data_cfg.val_split_fraction
    if not 0.0 <= fraction < 1.0:
        return [f"data.val_split_fraction={fraction}: must lie in [0, 1). Fix: e.g. 0.05, or 0 for none."]
    if fraction > 0 and data_cfg.val_file is not None:
        return [f"data.val_split_fraction={fraction} and data.val_file={data_cfg.val_file!r} both choose a "
                "validation set. Fix: set data.val_file=null to hold out part of the training data, or "
                "data.val_split_fraction=0 to use the file."]
    return []


def _check_choices(data_cfg: Any) -> list[str]:
    """The columns and the enumerated options: messages_key, train_on, max_length_policy, reasoning."""
    errors = []
    if data_cfg.messages_key is not None and not data_cfg.messages_key:
        errors.append("data.messages_key='': empty. Fix: name the column of chat turns, or null for prompt/response "
                      "rows.")
    for name, choices in (("train_on", TRAIN_ON), ("max_length_policy", MAX_LENGTH_POLICIES)):
        if getattr(data_cfg, name) not in choices:
            errors.append(f"data.{name}={getattr(data_cfg, name)!r}: unknown value. Fix: use one of {list(choices)}.")
    reasoning = getattr(data_cfg, "reasoning", "train")
    if reasoning not in REASONING_MODES:
        errors.append(f"data.reasoning={reasoning!r}: unknown value. Fix: use one of {list(REASONING_MODES)}.")
    elif reasoning == "answer_only" and data_cfg.train_on == "all":
        errors.append(
            "data.reasoning=answer_only with data.train_on=all: train_on=all makes every token a target, the "
            "reasoning's too. Fix: data.train_on=assistant (or last_assistant), or data.reasoning=train."
        )
    return errors


def _check_chat_template(template: str) -> list[str]:
    if template in CHAT_TEMPLATES or "{" in template:
        return []
    return [f"data.chat_template={template!r}: neither one of {list(CHAT_TEMPLATES)} nor a Jinja template. Fix: use "
            "auto (the tokenizer's template, else the built-in format), builtin, nemotron3 (the released Nemotron 3 "
            "template), tokenizer (its template's generation markers), or a template string."]


# ------------------------------------------------------------------------------- row checks
def _check_turns(turns: Any, where: str, cols: Columns) -> list[dict[str, Any]]:
    key = cols.messages_key
    if isinstance(turns, str):
        # CSV cells (and some exports) hold the conversation as a JSON string.
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{where}: {key!r} is a string that is not JSON ({e.msg}). Fix: store a list of "
                f"{{{cols.role_key!r}: ..., {cols.content_key!r}: ...}} turns."
            ) from e
    if not isinstance(turns, list):
        raise DataError(
            f"{where}: {key!r} must be a list of {{{cols.role_key!r}, {cols.content_key!r}}} turns, got "
            f"{type(turns).__name__}. Fix: store the conversation as a list of turn objects."
        )
    for n, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or cols.role_key not in turn or cols.content_key not in turn:
            have = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
            raise DataError(
                f"{where}: turn {n} of {key!r} must be an object with keys {cols.role_key!r} and "
                f"{cols.content_key!r}, got {have}. Fix: rename the keys, or set data.role_key / "
                "data.content_key to the ones this file uses."
            )
        role, content = turn[cols.role_key], turn[cols.content_key]
        if role not in ROLES:
            raise DataError(
                f"{where}: turn {n} has unknown role {role!r}. Fix: use one of {list(ROLES)} "
                "(map other roles, e.g. 'human'->'user', 'gpt'->'assistant', before training)."
            )
        if not isinstance(content, str):
            raise DataError(
                f"{where}: turn {n} ({role}) content must be a string, got {type(content).__name__}. "
                "Fix: store the text of each turn as a string."
            )
        reasoning = turn.get(REASONING_FIELD)
        if reasoning is not None and not isinstance(reasoning, str):
            raise DataError(
                f"{where}: turn {n} ({role}) {REASONING_FIELD!r} must be a string, got {type(reasoning).__name__}. "
                "Fix: store the reasoning as a string, or leave the key out."
            )
    return turns


def check_row(row: Any, where: str, cols: Columns) -> None:
    """Raise a `DataError` naming `where` unless `row` has the columns and types `cols` asks for."""
    if (own_check := getattr(cols, "check_row", None)) is not None:  # other row kinds (preference pairs)
        own_check(row, where)
        return
    if not isinstance(row, dict):
        raise DataError(
            f"{where}: expected a JSON object with keys {list(cols.required)}, got a JSON {type(row).__name__}. "
            "Fix: wrap the row as an object with those keys."
        )
    missing = [k for k in cols.required if k not in row]
    if missing:
        raise DataError(
            f"{where}: missing key(s) {missing}; the row has keys {sorted(row)}. Fix: add them, or point "
            "data.prompt_key/data.response_key (or data.messages_key for chat rows) at the columns this "
            "file uses."
        )
    if cols.is_chat:
        _check_turns(row[cols.messages_key], where, cols)
        return
    for key in cols.required:
        if not isinstance(row[key], str):
            raise DataError(
                f"{where}: {key!r} must be a string, got {type(row[key]).__name__} ({row[key]!r:.60}). "
                "Fix: store the text as a string."
            )


def turns_of(row: dict[str, Any], cols: Columns) -> list[dict[str, str]]:
    """The row as chat turns with the standard `role`/`content` keys (prompt/response rows too)."""
    if not cols.is_chat:
        return [{"role": "user", "content": row[cols.prompt_key]},
                {"role": "assistant", "content": row[cols.response_key]}]
    turns = row[cols.messages_key]
    if isinstance(turns, str):
        turns = json.loads(turns)
    out = []
    for t in turns:
        turn = {"role": t[cols.role_key], "content": t[cols.content_key]}
        if t.get(REASONING_FIELD) is not None:  # parquet/arrow fill a missing key with None
            turn[REASONING_FIELD] = t[REASONING_FIELD]
        out.append(turn)
    return out


# ------------------------------------------------------------------------------- loading
def import_datasets(field_name: str, value: str, kind: str) -> Any:
    """The `datasets` package, or a DataError naming the source that needs it and the install line."""
    try:
        import datasets
    except ImportError as e:
        what = "a Hugging Face hub dataset" if kind == "hub" else f"a {kind} file"
        raise DataError(
            f"{field_name}={value!r}: reading {what} needs the `datasets` package (with pyarrow and pandas), "
            f"which is not installed ({e}). Fix: {DATASETS_INSTALL}, or convert the data to a .jsonl file."
        ) from e
    return datasets


@contextlib.contextmanager
def _quiet_datasets(datasets: Any) -> Iterator[None]:
    # Every rank loads the data, so per-load progress bars would flood the logs.
    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.utils.enable_progress_bars()


def _no_rows(field_name: str, value: str, cols: Columns) -> DataError:
    return DataError(
        f"{field_name}={value!r}: the data set has no rows. Fix: fill it with rows holding "
        f"{list(cols.required)}, or point {field_name} at another source."
    )


def _utf8_error(path: Path, line_no: int, line_start: int, e: UnicodeDecodeError) -> DataError:
    """`e` decoding bytes whose line `line_no` starts at offset `line_start`."""
    return DataError(
        f"{path}:{line_no}: not valid UTF-8 (byte {e.object[e.start]:#04x} at byte {e.start - line_start + 1} of "
        f"the line: {e.reason}). Fix: re-encode the file as UTF-8."
    )


def _decode_line(raw: bytes, path: Path, line_no: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _utf8_error(path, line_no, 0, e) from e


def _check_jsonl(path: Path, cols: Columns) -> tuple[list[Any], list[int]]:
    """Check every line; returns the rows and the line number of each (blank lines hold none)."""
    rows: list[Any] = []
    line_of_row: list[int] = []
    # Read as bytes and decoded line by line: a text-mode reader decodes ahead in blocks, so its
    # UnicodeDecodeError would surface on an earlier line than the one holding the bad byte.
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if line_no == 1 and raw.startswith(_BOM):  # editors on Windows start UTF-8 files with a BOM
                raw = raw[len(_BOM):]
            line = _decode_line(raw, path, line_no)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{line_no}: invalid JSON ({e.msg} at column {e.colno}). Fix: make each line one "
                    "complete JSON object, or remove this line."
                ) from e
            check_row(row, f"{path}:{line_no}", cols)
            rows.append(row)
            line_of_row.append(line_no)
    return rows, line_of_row


def _check_json(path: Path, cols: Columns) -> tuple[list[Any], list[str]]:
    """Check every row of a JSON array (or of JSON Lines saved as .json); returns the rows and each
    row's location."""
    data = path.read_bytes()
    if data.startswith(_BOM):
        data = data[len(_BOM):]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no, line_start = data.count(b"\n", 0, e.start) + 1, data.rfind(b"\n", 0, e.start) + 1
        raise _utf8_error(path, line_no, line_start, e) from e
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):
            raise DataError(
                f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno}). Fix: the file must be one "
                "JSON array of row objects (or JSON Lines, one object per line)."
            ) from e
        # Many .json files are JSON Lines in disguise.
        rows, lines = _check_jsonl(path, cols)
        return rows, [f"{path}:{line}" for line in lines]
    if not isinstance(rows, list):
        raise DataError(
            f"{path}: expected a JSON array of row objects, got a JSON {type(rows).__name__}. Fix: store the "
            "rows as [{...}, {...}] or as JSON Lines."
        )
    where = [f"{path}: row {i + 1}" for i in range(len(rows))]
    for row, w in zip(rows, where):
        check_row(row, w, cols)
    return rows, where


def _check_dataset(ds: Any, label: str, cols: Columns) -> None:
    missing = [k for k in cols.required if k not in ds.column_names]
    if missing:
        raise DataError(
            f"{label}: missing column(s) {missing}; it has columns {ds.column_names}. Fix: rename them, or "
            f"point {getattr(cols, 'key_fields', 'data.prompt_key/data.response_key (or data.messages_key for chat rows)')}"
            " at these columns."
        )
    for i, row in enumerate(ds.select_columns(list(cols.required))):
        check_row(row, f"{label}: row {i + 1}", cols)


def _has_no_rows(path: Path, kind: str) -> bool:
    import pandas as pd
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            return pq.ParquetFile(path).metadata.num_rows == 0
        return pd.read_csv(path, nrows=1).empty
    except pd.errors.EmptyDataError:
        return True
    except Exception:  # unreadable: `datasets` then reports it, with the file name
        return False


def load_rows(
    value: str,
    *,
    field_name: str,
    cols: Columns,
    fmt: Optional[str] = None,
    split: str = "train",
) -> Rows:
    """Read and check one source: a local file (format from `fmt` or its extension) or a hub id."""
    kind = source_format(value, fmt)
    if kind == "hub":
        return _load_hub(value, field_name=field_name, cols=cols, split=split)
    p = Path(value).expanduser()
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else "does not exist"
        raise DataError(
            f"{field_name}={value!r}: {what}. Fix: set {field_name} to a .jsonl/.json/.parquet/.csv file with "
            f"{list(cols.required)} in each row (relative paths resolve against the launch directory)."
        )
    if kind not in FILE_FORMATS:
        raise DataError(
            f"{field_name}={value!r}: cannot tell the format from the extension {p.suffix!r}. Fix: set "
            f"data.format to one of {list(FILE_FORMATS)}."
        )
    if kind in ("jsonl", "json"):
        # Read here rather than by `datasets`: its JSON reader names neither line nor key.
        if kind == "jsonl":
            records, lines = _check_jsonl(p, cols)
            locations = [f"{p}:{line}" for line in lines]
        else:
            records, locations = _check_json(p, cols)
        if not records:
            raise _no_rows(field_name, value, cols)
        return Rows(records, locations.__getitem__)
    return _load_table(p, kind, field_name=field_name, value=value, cols=cols)


def _load_table(p: Path, kind: str, *, field_name: str, value: str, cols: Columns) -> Rows:
    """A Parquet or CSV file, read through `datasets`."""
    datasets = import_datasets(field_name, value, kind)
    if _has_no_rows(p, kind):
        # `datasets` fails on row-less Parquet and CSV files with errors that do not say so.
        raise _no_rows(field_name, value, cols)
    try:
        with _quiet_datasets(datasets):
            ds = datasets.load_dataset(_BUILDERS[kind], data_files=str(p), split="train")
    except Exception as e:  # pyarrow and pandas raise many unrelated types for unreadable files
        raise DataError(
            f"{field_name}={value!r}: `datasets` could not read it as {kind} ({type(e).__name__}: {e}). "
            f"Fix: check the file is valid {kind}, or set data.format to its real format."
        ) from e
    _check_dataset(ds, str(p), cols)
    if len(ds) == 0:
        raise _no_rows(field_name, value, cols)
    return Rows(ds, lambda i: f"{p}: row {i + 1}")


def _load_hub(name: str, *, field_name: str, cols: Columns, split: str) -> Rows:
    split_field = "data.val_split" if field_name == "data.val_file" else "data.train_split"
    datasets = import_datasets(field_name, name, "hub")
    try:
        with _quiet_datasets(datasets):
            ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # offline, unknown name, unknown split, gated...: all end the same way
        raise DataError(
            f"{field_name}={name!r}: could not load this Hugging Face hub dataset ({split_field}={split!r}): "
            f"{type(e).__name__}: {str(e)[:300]}. Fix: check the name, the split and network access (set "
            "HF_DATASETS_OFFLINE=1 to use a cached copy), or download it and point "
            f"{field_name} at a local .jsonl/.json/.parquet/.csv file."
        ) from e
    if not isinstance(ds, datasets.Dataset):
        raise DataError(
            f"{field_name}={name!r}: loading split {split!r} gave a {type(ds).__name__}, not one table. "
            f"Fix: set {split_field} to one split name (e.g. 'train')."
        )
    label = f"{name} [{split}]"
    _check_dataset(ds, label, cols)
    if len(ds) == 0:
        raise _no_rows(field_name, name, cols)
    return Rows(ds, lambda i: f"{label}: row {i + 1}")
