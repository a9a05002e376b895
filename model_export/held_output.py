"""TensorFlow's own diagnostics held back during an export, so that an error the export explains
is one clear message, not the converter's pages of C++ log lines before it (`--verbose` shows them).

They are written from C++ to file descriptor 2, past `sys.stderr`, so the descriptor itself is
redirected while the export runs. The caller turns the errors it explains into its message; any
exception that leaves the block gets them replayed: a crash must not lose its evidence."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def native_stderr_held(verbose: bool) -> Iterator[None]:
    if verbose:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        replay = False
        try:
            yield
        except BaseException:
            replay = True
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if replay:
                held.seek(0)
                sys.stderr.write(held.read().decode(errors="replace"))
