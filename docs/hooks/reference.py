"""MkDocs hook: the reference pages' generated parts, so that they cannot drift from the code.

A page line `<!-- cli: python -m orchestrator serve -->` becomes that command's `--help`, produced
by its own argparse parser in this process; `<!-- settings: NAME -->` becomes a table of the
settings NAME (population, buffered, secure, task_config, server) with their types, ranges and defaults,
read from the pydantic models' field constraints and the task config's documented maxima.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import os
import re
import runpy
import sys
import textwrap
from dataclasses import MISSING, fields
from typing import Any

# Defaults that depend on the machine are shown by name: the data-set cache and the help's width.
os.environ["FEDRECON_DATA_DIR"] = "$FEDRECON_DATA_DIR"  # data files' defaults read it at import
os.environ["COLUMNS"] = "100"

_CLI = re.compile(r"^<!-- cli: (?P<command>[^>]+?) -->$", re.MULTILINE)
_SETTINGS = re.compile(r"^<!-- settings: (?P<name>[a-z_]+) -->$", re.MULTILINE)


def cli_help(command: str) -> str:
    """`command --help` (e.g. "python -m orchestrator serve"), from its parser, in this process."""
    words = command.split()
    if words[:2] != ["python", "-m"] or len(words) < 3:
        raise ValueError(f"a cli marker names `python -m MODULE [SUBCOMMAND]`, got {command!r}")
    module, args = words[2], [*words[3:], "--help"]
    out, argv = io.StringIO(), sys.argv
    sys.argv = [module, *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = argv
    text = out.getvalue().rstrip()
    if not text.startswith("usage:"):
        raise ValueError(f"{command} --help printed no usage")
    return f"```text\n$ {command} --help\n{text}\n```"


def _comments(cls: type) -> dict[str, str]:
    """Each field's comment in the class's source: on its line, else the lines just above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        line = lines[node.end_lineno - 1 if node.end_lineno else node.lineno - 1]
        comment = line.split("  # ", 1)[1] if "  # " in line else ""
        if not comment:
            above: list[str] = []
            number = node.lineno - 2
            while number >= 0 and lines[number].strip().startswith("#"):
                above.insert(0, lines[number].strip().lstrip("# "))
                number -= 1
            comment = " ".join(above)
        found[node.target.id] = comment
    return found


def _bounds(metadata: list[Any]) -> str:
    parts = []
    for item in metadata:
        for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, name, None)
            if value is not None:
                parts.append(f"{sign} {_number(value)}")
    return ", ".join(parts)


def _number(value: float) -> str:
    whole = isinstance(value, int) or (float(value).is_integer() and abs(value) < 1e9)
    return f"{int(value):,}" if whole else f"{value:g}"


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return f'`"{value}"`'
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if hasattr(value, "model_dump") or value == "(below)":
        return "(below)"
    return f"`{value!r}`"


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    text = text.replace("typing.", "").replace("NoneType", "null")
    return f"`{text}`"


def _pydantic_table(model: Any, prefix: str = "") -> str:
    comments = _comments(model)
    rows = ["| setting | type | range | default | what |", "| --- | --- | --- | --- | --- |"]
    for name, info in model.model_fields.items():
        default = info.get_default(call_default_factory=True)
        what = (info.description or comments.get(name, "")).replace("|", "\\|")
        choices = getattr(info.annotation, "__args__", ())
        literal = str(info.annotation).startswith("typing.Literal")
        rng = " or ".join(f"`{c}`" for c in choices) if literal else _bounds(info.metadata)
        kind = "`string`" if literal else _type(info.annotation)
        if "dict" in str(info.annotation):
            kind, rng = "`object`", "(below)"
            default = "(below)" if default else default
        rows.append(f"| `{prefix}{name}` | {kind} | {rng} | {_shown(default)} | {what} |")
    return "\n".join(rows)


# What the task config's fields do, where the dataclass has no comment of its own.
_TASK_CONFIG_NOTES = {
    "split": "how a task splits its examples into support (reconstruction) and query (update) sets",
    "min_examples": "fewer usable examples: the task aborts (the population's min_examples)",
    "max_examples": "the newest this many examples take part in a task",
    "reconstruction_learning_rate": "SGD rate of the local parameters in `reconstruct`",
    "reconstruction_max_epochs": "passes over the support batches in `reconstruct`",
    "reconstruction_max_steps": "steps of `reconstruct` at most",
    "update_learning_rate": "SGD rate of the global parameters in `update`",
    "update_max_epochs": "passes over the query batches in `update`",
    "update_max_steps": "steps of `update` at most",
    "l2_global": "L2 weight on the global rows a batch uses",
    "l2_local": "L2 weight on the local parameters",
    "local_state": "reconstruct: FedRecon, locals fitted afresh each task; keep: FURL, locals kept on the "
    "device across rounds",
}


def _task_config_table() -> str:
    from contracts.task_config import (
        FLOAT32_MAX,
        INT32_MAX,
        MAX_CENTRAL_ONLY_ITEMS,
        TASK_CONFIG_MAXIMA,
        LocalState,
        SplitPolicy,
        TaskConfig,
    )

    comments = _comments(TaskConfig)
    rows = ["| setting | type | range | default | what |", "| --- | --- | --- | --- | --- |"]
    for f in fields(TaskConfig):
        kind = str(f.type)
        if kind == "SplitPolicy":
            rng = " or ".join(f"`{p.value}`" for p in SplitPolicy)
        elif kind == "LocalState":
            rng = " or ".join(f"`{s.value}`" for s in LocalState)
        elif kind == "bool":
            rng = "`true` or `false`"
        elif kind.startswith("tuple"):
            kind = "list[int]"
            rng = f"at most {MAX_CENTRAL_ONLY_ITEMS:,} rows of the model's catalog"
        else:
            highest = TASK_CONFIG_MAXIMA.get(f.name, INT32_MAX if kind.startswith("int") else FLOAT32_MAX)
            low = 1 if f.name == "min_examples" else 0
            rng = f"[{low}, {_number(highest)}]"
            if f.name == "clip_norm":
                rng = f"(0, {_number(highest)}] or `null`"
        default = f.default if f.default is not MISSING else None
        if isinstance(default, SplitPolicy | LocalState):
            default = default.value
        if isinstance(default, tuple):
            default = list(default)
        what = (comments.get(f.name) or _TASK_CONFIG_NOTES.get(f.name, "")).replace("|", "\\|")
        rows.append(f"| `task_config.{f.name}` | `{kind}` | {rng} | {_shown(default)} | {what} |")
    return "\n".join(rows)


def settings_table(name: str) -> str:
    if name == "population":
        from orchestrator.populations.settings import PopulationSettings

        return _pydantic_table(PopulationSettings)
    if name == "buffered":
        from orchestrator.populations.settings import BufferedSettings

        return _pydantic_table(BufferedSettings, "buffered.")
    if name == "secure":
        from orchestrator.populations.settings import SecureAggregationSettings

        return _pydantic_table(SecureAggregationSettings, "secure.")
    if name == "task_config":
        return _task_config_table()
    if name == "server":
        from orchestrator.settings import Settings

        table = _pydantic_table(Settings)
        # The server's settings are environment variables.
        return re.sub(r"^\| `([a-z_]+)`", lambda m: f"| `ORCHESTRATOR_{m[1].upper()}`", table, flags=re.M)
    raise ValueError(
        f"unknown settings table {name!r}; expected population, buffered, secure, task_config or server"
    )


def on_page_markdown(markdown: str, **_: Any) -> str:
    markdown = _CLI.sub(lambda m: cli_help(m["command"]), markdown)
    return _SETTINGS.sub(lambda m: settings_table(m["name"]), markdown)
