"""How every command line of the project ends: when its reader goes away (`... | head`), quietly,
as Unix tools do, not with a traceback for a pipe that was closed on purpose; on bad input, with
one line (`CommandParser`)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn, ParamSpec

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


class _DefaultOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help once: not after a help that already says it (or says
    what an absent option means), and not for an option whose absence is its default (None)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.default is argparse.SUPPRESS or "default" in text:
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """The project's command lines' parser: bad input is one line on stderr, what was wrong and
    where the help is, exit code 2 (argparse's own prints the whole usage first: 49 lines for
    `android_sim run --rounds abc`). Its subcommands' parsers are of this class too, and one
    asking for argparse's defaults formatter gets `_DefaultOnce`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("formatter_class") is argparse.ArgumentDefaultsHelpFormatter:
            kwargs["formatter_class"] = _DefaultOnce
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (use {self.prog} --help)\n")
