"""The device's model cache: each model in a folder named by its content address (the model
file's sha256), with its manifest. Every use checks the cached files against the address; a
damaged file is deleted (and downloaded again by the caller), never used. Files are written under
a temporary name and renamed, so no reader (and no crash) leaves half a file."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from contracts.manifest import Manifest
from device_runtime.protocol_errors import InvalidAnswer
from device_runtime.server_answers import MAX_ANSWER_BYTES


def model_manifest(data: dict[str, Any], sha256: str) -> Manifest:
    """A downloaded manifest, usable only if it describes the model at `sha256`."""
    try:
        manifest = Manifest.from_json(data)
    except (ValueError, TypeError) as e:  # ManifestError, or a shape the parser did not foresee
        raise InvalidAnswer(f"the model's manifest is not valid: {e}") from None
    if manifest.model_sha256 != sha256:
        raise InvalidAnswer(
            f"the model's manifest describes a model with sha256 {manifest.model_sha256[:12]}...; "
            f"expected {sha256[:12]}..., the assignment's model"
        )
    if not 0 < manifest.model_bytes <= MAX_ANSWER_BYTES:
        raise InvalidAnswer(
            f"the model's manifest says the model has {manifest.model_bytes} bytes; "
            f"expected 1 to {MAX_ANSWER_BYTES}"
        )
    return manifest


# Content addresses are immutable, so a model file verified once needs no second hash for as
# long as nothing has touched it (same inode, size and modification time): a fleet of simulated
# devices sharing one cache then hashes each model once, not on every participation.
_INTACT: dict[Path, tuple[int, int, int]] = {}


def _file_identity(path: Path) -> tuple[int, int, int]:
    stat = path.stat()
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def remember_intact(path: Path) -> None:
    _INTACT[path] = _file_identity(path)


def cached_model_intact(path: Path, sha256: str) -> bool:
    """Whether the cached model is there and is the one at `sha256`; a damaged one is deleted."""
    try:
        if _INTACT.get(path) == _file_identity(path):
            return True
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return False
    if digest != sha256:
        _INTACT.pop(path, None)
        path.unlink(missing_ok=True)
        return False
    remember_intact(path)
    return True


def cached_manifest(path: Path, sha256: str) -> Manifest | None:
    """The cached manifest if it is there, valid, and describes the model at `sha256`; a damaged
    one is deleted."""
    try:
        return model_manifest(json.loads(path.read_bytes()), sha256)
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError, InvalidAnswer):  # unreadable, or not this model's
        path.unlink(missing_ok=True)
        return None


def write_atomically(path: Path, content: bytes) -> None:
    """Write under a temporary name, then rename: a reader (or a crash) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        temporary.write_bytes(content)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
