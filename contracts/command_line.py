"""How every command line of the project ends when its reader goes away (`... | head`): quietly,
as Unix tools do, not with a traceback for a pipe that was closed on purpose."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import ParamSpec

P = ParamSpec("P")

# What a process that SIGPIPE ends exits with in a shell (128 + 13): Python ignores SIGPIPE so
# that a server's closed socket is an error it can handle, so commands return it themselves.
CLOSED_PIPE_EXIT = 141


def quiet_on_closed_pipe(main: Callable[P, int]) -> Callable[P, int]:
    """`main`, returning `CLOSED_PIPE_EXIT` without a word when its standard output is a pipe
    whose reader has closed it."""

    @functools.wraps(main)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            try:
                return main(*args, **kwargs)
            finally:
                sys.stdout.flush()  # here, not at exit: a short output fails only when flushed
        except BrokenPipeError:
            # What is still buffered would fail again at exit: it goes nowhere instead.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return CLOSED_PIPE_EXIT

    return wrapped
