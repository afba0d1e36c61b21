"""`open_model`: the one entry point from a user's model argument to a `ModelSource`."""

from __future__ import annotations

from pathlib import Path

from llmopt.errors import InputError
from llmopt.model.gguf_file import GGUFSource
from llmopt.model.gguf_header import MAGIC as GGUF_MAGIC
from llmopt.model.hub import looks_like_hub_id, resolve_hub_id
from llmopt.model.source import ModelSource, file_stamps


def open_model(spec: str | Path) -> ModelSource:
    """An HF directory, a GGUF file, or a hub id (cached, or downloaded when online), with its files'
    sizes and times as they were before it was read (`ModelSource.check_unchanged`)."""
    path = Path(spec).expanduser()
    stamps = file_stamps(path)
    source = _open(spec, path)
    source.stamps = stamps if Path(source.path).expanduser() == path else file_stamps(Path(source.path))
    return source


def _open(spec: str | Path, path: Path) -> ModelSource:
    if path.is_dir():
        from llmopt.model.quantized_dir import open_hf_dir  # torch: a GGUF's header is read without it

        return open_hf_dir(path)
    if path.is_file():
        with path.open("rb") as f:
            magic = f.read(4)
        if magic == GGUF_MAGIC or path.suffix.lower() == ".gguf":
            return GGUFSource(path)
        if path.name == "config.json":
            from llmopt.model.quantized_dir import open_hf_dir

            return open_hf_dir(path.parent)
        raise InputError(f"{path}: not a model (expected an HF directory or a .gguf file)")
    if path.exists():
        raise InputError(f"{path}: not a regular file or directory")
    if looks_like_hub_id(str(spec)) and not path.parent.exists():  # "build/x" with build/ present is a path
        from llmopt.model.quantized_dir import open_hf_dir

        return open_hf_dir(resolve_hub_id(str(spec)))
    raise InputError(f"{spec}: no such file or directory")
