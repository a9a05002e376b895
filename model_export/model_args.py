"""`--model-arg key=value`: a model builder's keyword arguments from the command line.

A builder (`--model my_pkg.my_model:build`) declares what it takes as keyword parameters with
defaults and type annotations, `def build(num_tokens: int = 1000, local: bool = True) ->
ExportSpec`; each `--model-arg` names one of them and gives its value as text, converted by the
annotation (int, float, bool, str). An unknown name, a parameter given twice or a value of the
wrong type is refused before the builder runs, with a message that lists what the builder takes.
"""

from __future__ import annotations

import inspect
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
SUPPORTED_TYPES: tuple[type, ...] = (int, float, bool, str)


class ModelArgError(ValueError):
    """A `--model-arg` the builder cannot take; the message says what it takes."""


def parameters(build: Callable[..., Any]) -> dict[str, tuple[type, Any]]:
    """The builder's keyword parameters: name -> (type, default). Parameters of other types, or
    without a default, cannot come from the command line and are refused here."""
    try:
        hints = typing.get_type_hints(build)
    except (NameError, TypeError) as e:
        raise ModelArgError(f"cannot read the type annotations of {_name(build)}: {e}") from None
    found: dict[str, tuple[type, Any]] = {}
    for name, parameter in inspect.signature(build).parameters.items():
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        kind = hints.get(name)
        if kind not in SUPPORTED_TYPES or parameter.default is inspect.Parameter.empty:
            raise ModelArgError(
                f"{_name(build)}'s parameter {name!r} must have a default and one of the types "
                f"{', '.join(t.__name__ for t in SUPPORTED_TYPES)} to be set with --model-arg; "
                f"it has {getattr(kind, '__name__', kind)} and "
                f"{'no default' if parameter.default is inspect.Parameter.empty else 'a default'}"
            )
        assert isinstance(kind, type)
        found[name] = (kind, parameter.default)
    return found


def parse_model_args(build: Callable[..., Any], pairs: Sequence[str]) -> dict[str, Any]:
    """`["key=value", ...]` as keyword arguments of `build`, each converted to its parameter's type."""
    accepted = parameters(build) if pairs else {}
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ModelArgError(f"--model-arg takes KEY=VALUE, e.g. num_oov_buckets=100; got {pair!r}")
        if key not in accepted:
            raise ModelArgError(f"{_name(build)} takes no argument {key!r}; it takes: {describe(accepted)}")
        if key in values:
            raise ModelArgError(f"--model-arg {key} is given twice")
        values[key] = _convert(key, raw, accepted[key][0])
    return values


def format_model_args(values: Mapping[str, Any]) -> list[str]:
    """The command-line arguments that give `values` to a builder (what `parse_model_args` reads)."""
    out: list[str] = []
    for key, value in values.items():
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        out += ["--model-arg", f"{key}={text}"]
    return out


def describe(accepted: Mapping[str, tuple[type, Any]]) -> str:
    if not accepted:
        return "no arguments"
    return ", ".join(
        f"{name} ({kind.__name__}, default {default!r})" for name, (kind, default) in accepted.items()
    )


def _convert(key: str, raw: str, kind: type) -> Any:
    text = raw.strip()
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ModelArgError(f"--model-arg {key}={raw!r}: expected true or false")
    if kind is str:
        return raw
    expected = "an integer" if kind is int else "a finite number"
    try:
        value = kind(text)
    except ValueError:
        raise ModelArgError(f"--model-arg {key}={raw!r}: expected {expected}") from None
    if not math.isfinite(value):
        raise ModelArgError(f"--model-arg {key}={raw!r}: expected {expected}")
    return value


def _name(build: Callable[..., Any]) -> str:
    return f"{getattr(build, '__module__', '?')}:{getattr(build, '__qualname__', build)}"
