"""The example spec of a model: its named features, and column-wise examples checked against it.

A model declares what one example is: named features with a dtype and a per-example shape,
each either an `input` of the model or a `label`. An integer feature that indexes an
embedding table names it (`tables`: the tables it indexes) and its range is the table's rows. `Examples`
holds many examples column-wise (as FedJAX's client datasets do): one array per feature
whose first axis is the example. Validation says which feature of which example is wrong
and what was expected, so a store can refuse a bad write before it writes anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DTYPES = ("float32", "int32")
ROLES = ("input", "label")


class InvalidExamples(ValueError):
    """Examples the model cannot take: unknown or missing features, wrong dtype or shape, values
    out of range or not finite."""


class FeatureSpecError(ValueError):
    """A feature declaration that is malformed."""


@dataclass(frozen=True)
class FeatureSpec:
    """One feature of an example.

    `value_range` is inclusive; an integer feature that indexes embedding tables (`tables`)
    has the range [0, rows - 1]. `discrete`: the values must be whole numbers (e.g. implicit
    feedback's 0/1 labels with range [0, 1]).
    """

    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    role: str = "input"
    value_range: tuple[float, float] | None = None
    discrete: bool = False
    tables: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = []
        if not self.name or not self.name.isidentifier():
            problems.append(f"name must be an identifier, got {self.name!r}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in self.shape):
            problems.append(f"shape must be a tuple of ints >= 1, got {self.shape!r}")
        if self.role not in ROLES:
            problems.append(f"role must be one of {ROLES}, got {self.role!r}")
        if self.value_range is not None and not (
            len(self.value_range) == 2
            and all(np.isfinite(self.value_range))
            and self.value_range[0] <= self.value_range[1]
        ):
            problems.append(f"value_range must be [low, high] with low <= high, got {self.value_range!r}")
        if self.tables and (self.dtype != "int32" or self.value_range is None):
            problems.append("a feature that indexes a table must be int32 with a value_range of the rows")
        if problems:
            raise FeatureSpecError(f"feature {self.name!r}: " + "; ".join(problems))

    @property
    def num_values(self) -> int:
        """Distinct values of an indexing feature: the rows of its table."""
        if self.value_range is None:
            raise FeatureSpecError(f"feature {self.name!r} has no value_range")
        return int(self.value_range[1]) + 1

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        data["role"] = self.role
        if self.value_range is not None:
            data["range"] = list(self.value_range)
        if self.discrete:
            data["discrete"] = True
        if self.tables:
            data["tables"] = list(self.tables)
        return data

    @classmethod
    def from_json(cls, data: Any) -> FeatureSpec:
        if not isinstance(data, dict):
            raise FeatureSpecError(f"a feature must be an object with name, dtype, shape, role; got {data!r}")
        known = {"name", "dtype", "shape", "role", "range", "discrete", "tables"}
        if set(data) - known:
            raise FeatureSpecError(
                f"feature {data.get('name')!r}: unknown fields {sorted(set(data) - known)}"
            )
        shape, value_range = data.get("shape", []), data.get("range")
        if not isinstance(shape, list):
            raise FeatureSpecError(f"feature {data.get('name')!r}: shape must be a list, got {shape!r}")
        if value_range is not None and (
            not isinstance(value_range, list)
            or len(value_range) != 2
            or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in value_range)
        ):
            raise FeatureSpecError(f"feature {data.get('name')!r}: range must be [low, high]")
        return cls(
            name=str(data.get("name", "")),
            dtype=str(data.get("dtype", "")),
            shape=tuple(shape),
            role=str(data.get("role", "")),
            value_range=None if value_range is None else (float(value_range[0]), float(value_range[1])),
            discrete=bool(data.get("discrete", False)),
            tables=tuple(str(t) for t in data.get("tables", [])),
        )


def check_feature_specs(features: Sequence[FeatureSpec]) -> None:
    """Distinct names and at least one input; a FeatureSpecError otherwise."""
    names = [f.name for f in features]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise FeatureSpecError(f"feature names must be distinct; repeated: {repeated}")
    if not any(f.role == "input" for f in features):
        raise FeatureSpecError("the features must include at least one input")


class Examples:
    """Column-wise examples: `examples[name][i]` is feature `name` of example `i`; `len` is the
    number of examples (as FedJAX's client datasets: the columns are `columns`, a Mapping).

    Constructing from columns checks only that they are arrays of one length; `validated`
    checks them against a spec and casts to the declared dtypes.
    """

    def __init__(self, columns: Mapping[str, np.ndarray]) -> None:
        self._columns = {k: np.asarray(v) for k, v in columns.items()}
        lengths = {k: (v.shape[0] if v.ndim else -1) for k, v in self._columns.items()}
        if len(set(lengths.values())) > 1 or -1 in lengths.values():
            raise InvalidExamples(f"every feature needs one value per example; lengths {lengths}")
        self._length = next(iter(lengths.values()), 0)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._columns[name]

    def __contains__(self, name: str) -> bool:
        return name in self._columns

    @property
    def columns(self) -> Mapping[str, np.ndarray]:
        return self._columns

    def __len__(self) -> int:
        return int(self._length)

    @property
    def num_examples(self) -> int:
        return int(self._length)

    def select(self, index: slice | np.ndarray) -> Examples:
        """The examples at `index` (a slice, a boolean mask or integer positions)."""
        return Examples({k: v[index] for k, v in self._columns.items()})

    @classmethod
    def empty(cls, features: Sequence[FeatureSpec]) -> Examples:
        return cls({f.name: np.zeros((0, *f.shape), f.dtype) for f in features})

    @classmethod
    def concat(cls, parts: Sequence[Examples], features: Sequence[FeatureSpec]) -> Examples:
        if not parts:
            return cls.empty(features)
        return cls({f.name: np.concatenate([p[f.name] for p in parts]) for f in features})

    def validated(self, features: Sequence[FeatureSpec]) -> Examples:
        """These examples cast to the spec's dtypes; `InvalidExamples` says what was wrong."""
        declared = {f.name for f in features}
        missing, extra = declared - set(self._columns), set(self._columns) - declared
        if missing or extra:
            raise InvalidExamples(
                f"examples must have exactly the features {sorted(declared)}"
                + (f"; missing {sorted(missing)}" if missing else "")
                + (f"; unexpected {sorted(extra)}" if extra else "")
            )
        return Examples({f.name: _checked_column(f, self._columns[f.name]) for f in features})


def _checked_column(feature: FeatureSpec, column: np.ndarray) -> np.ndarray:
    name = feature.name
    if column.shape[1:] != feature.shape:
        raise InvalidExamples(
            f"feature {name!r}: each example must have shape {list(feature.shape)}, "
            f"got {list(column.shape[1:])}"
        )
    kind = column.dtype.kind
    if feature.dtype == "int32":
        if kind not in "iu":
            raise InvalidExamples(f"feature {name!r} must be integers (int32), got {column.dtype}")
        if column.size and (column.min() < -(2**31) or column.max() >= 2**31):
            raise InvalidExamples(f"feature {name!r} must fit int32, got values up to {column.max()}")
    elif kind not in "iuf":
        raise InvalidExamples(f"feature {name!r} must be numbers (float32), got {column.dtype}")
    if kind == "f" and not np.all(np.isfinite(column)):
        bad = np.flatnonzero(~np.all(np.isfinite(per_example(column)), axis=1))
        raise InvalidExamples(f"feature {name!r} of example {int(bad[0])} is NaN or infinite")
    if feature.value_range is not None and column.size:
        low, high = feature.value_range
        flat = per_example(column)
        out = np.flatnonzero(np.any((flat < low) | (flat > high), axis=1))
        if out.size:
            i = int(out[0])
            what = f"the rows of {list(feature.tables)}" if feature.tables else "its range"
            raise InvalidExamples(
                f"{out.size} example(s) have feature {name!r} outside {what} "
                f"[{_number(low)}, {_number(high)}], e.g. example {i}: {flat[i].tolist()}"
            )
    if feature.discrete and kind == "f" and not np.all(column == np.round(column)):
        raise InvalidExamples(f"feature {name!r} must take whole values, e.g. 0 or 1")
    return column.astype(feature.dtype, copy=False)


def per_example(column: np.ndarray) -> np.ndarray:
    """A column as [examples, values of one example] (also when there are no examples)."""
    return column.reshape(column.shape[0], int(np.prod(column.shape[1:], dtype=np.int64)))


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
