"""Calibration text: local files (.txt, .jsonl, .parquet), `datasets` presets when online.

`read_texts(spec, field)` returns documents in file order. It knows nothing about models; the
token sampling in `samples.py` and imatrix collection both start from it. Model-generated text
(`--calib self`) lives in `self_text.py` because it needs the model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from llmopt.errors import InputError, OptionError

# name -> (datasets path, config, split, text field, data_files)
PRESETS: dict[str, tuple[str, str | None, str, str, str | None]] = {
    "wikitext2": ("wikitext", "wikitext-2-raw-v1", "train", "text", None),
    "c4": ("allenai/c4", None, "train", "text", "en/c4-train.00000-of-01024.json.gz"),
    "pileval": ("mit-han-lab/pile-val-backup", None, "validation", "text", None),
}
SELF = "self"


@dataclass(frozen=True)
class CalibText:
    documents: list[str]
    source: str  # what the user named (a path or a preset)
    sha256: str  # of the text as used, for provenance


def read_texts(spec: str, field: str | None = None) -> CalibText:
    """Documents of a calibration source: a path to .txt/.jsonl/.parquet, or a preset name."""
    path = Path(spec).expanduser()
    if spec in PRESETS and not path.exists():
        docs = _from_datasets(spec)
    elif path.is_dir():
        raise OptionError(f"<calib> {spec}: is a directory; give a .txt, .jsonl or .parquet file")
    elif path.is_file():
        docs = _from_file(path, field)
    else:
        hint = f" (presets: {', '.join(PRESETS)}, or 'self')"
        raise OptionError(f"<calib> {spec}: no such file{hint}")
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise OptionError(f"<calib> {spec}: the calibration source holds no text")
    digest = hashlib.sha256()
    for d in docs:
        digest.update(d.encode("utf-8"))
        digest.update(b"\0")
    return CalibText(docs, spec, digest.hexdigest())


def _from_file(path: Path, field: str | None) -> list[str]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl" or suffix == ".json":
        return _from_jsonl(path, field or "text")
    if suffix == ".parquet":
        return _from_parquet(path, field or "text")
    if field is not None:
        raise OptionError(f"<calib_field> applies to .jsonl and .parquet files, not {path.name}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise OptionError(f"<calib> {path}: not UTF-8 text") from None
    return [text]


def _from_jsonl(path: Path, field: str) -> list[str]:
    docs = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise OptionError(f"<calib> {path}:{n}: not a JSON line ({e.msg})") from None
            if not isinstance(record, dict) or field not in record:
                raise OptionError(f"<calib> {path}:{n}: no field {field!r} (choose one with <calib_field>)")
            value = record[field]
            if not isinstance(value, str):
                raise OptionError(f"<calib> {path}:{n}: field {field!r} is not a string")
            docs.append(value)
    return docs


def _from_parquet(path: Path, field: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError("reading .parquet calibration files needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for bad files
        raise OptionError(f"<calib> {path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    if field not in table.column_names:
        raise OptionError(f"<calib> {path}: no column {field!r} (columns: {', '.join(table.column_names)}; choose with <calib_field>)")
    return [v for v in table.column(field).to_pylist() if isinstance(v, str)]


def _from_datasets(name: str) -> list[str]:
    path, config, split, field, data_files = PRESETS[name]
    try:
        import datasets
    except ImportError:
        raise OptionError(f"<calib> {name}: the preset needs the `datasets` package (pip install datasets), or give a local file") from None
    try:
        kwargs = {"data_files": data_files} if data_files else {}
        ds = datasets.load_dataset(path, config, split=split, **kwargs)
    except Exception as e:  # offline, missing, or refused: one line either way
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise OptionError(f"<calib> {name}: could not load {path} from the hub ({first}); offline? give a local .txt/.jsonl/.parquet file or <calib> self") from None
    return [r for r in ds[field] if isinstance(r, str)]
