"""The device's private keys in a directory of their own, apart from its examples.

A key is one file, readable by its owner only, written whole or not at all (a temporary file,
flushed to the disk, then renamed over the old one), so a crash leaves the previous key or the
new one. On a phone the platform's key store (Android Keystore, the iOS Keychain) takes this
place; the example store never holds a private key.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


class KeyDirectory:
    """A `KeyStore` (device_runtime.task_environment) in the directory `path` (made, owner only)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)

    def _file(self, name: str) -> Path:
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"a key's name is 1 to 64 of a-z, 0-9, '-' and '_' (a letter or digit first), got {name!r}"
            )
        return self.path / f"{name}.key"

    def load_key(self, name: str) -> bytes | None:
        try:
            return self._file(name).read_bytes()
        except FileNotFoundError:
            return None

    def save_key(self, name: str, value: bytes) -> None:
        final = self._file(name)
        temporary = final.with_suffix(".tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, value)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, final)
