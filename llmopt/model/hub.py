"""Hub ids ("org/name"): resolved through huggingface_hub's cache, downloading only when online."""

from __future__ import annotations

import os
import re
from pathlib import Path

from llmopt.errors import InputError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Only what llmopt reads: never pickled weights.
_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt"]


def looks_like_hub_id(spec: str) -> bool:
    return bool(HUB_ID.match(spec)) and not spec.startswith((".", "/"))


def resolve_hub_id(repo_id: str, revision: str | None = None) -> Path:
    """A local snapshot directory for `repo_id`: the cached one, else a download when online."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_PATTERNS, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise InputError(f"{repo_id}: no such local path, and the hub id is not in the cache (HF_HUB_OFFLINE is set)")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_PATTERNS))
    except RepositoryNotFoundError:
        raise InputError(f"{repo_id}: no such local path, and no such model on the hub") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{repo_id}: no such local path, not in the hub cache, and the hub cannot be reached ({first})") from None
