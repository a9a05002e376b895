"""What the server asks a device to do in a task: the split policy, steps, rates, limits.

Shared by the orchestrator (population settings, assignments) and the device (client task).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from contracts.manifest import Manifest


class SplitPolicy(enum.StrEnum):
    ALTERNATE = "alternate"  # even batches support, odd batches query (the paper's default)
    REUSE = "reuse"  # every example in both support and query


# The largest value each task-config number may take. The signatures take steps as int32 and
# rates as float32, which a larger number would wrap or overflow inside the model; these bounds
# are far below that and still far above any sensible task (the paper uses <= 50 steps, and a
# step costs about 1 ms). A field not listed here is bounded by its signature type.
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
TASK_CONFIG_MAXIMA: dict[str, int | float] = {
    "reuse_below": 1_000_000,
    "min_examples": 1_000_000,
    "max_examples": 1_000_000,
    "shuffle_seed": 2**32 - 1,
    "reconstruction_learning_rate": 1_000.0,
    "reconstruction_max_epochs": 1_000,
    "reconstruction_max_steps": 10_000,
    "update_learning_rate": 1_000.0,
    "update_max_epochs": 1_000,
    "update_max_steps": 10_000,
    "local_learning_rate": 1_000.0,
    "clip_norm": 1e9,
    "l2_global": 1_000.0,
    "l2_local": 1_000.0,
    "negatives_per_positive": 100,
    "reconstruction_negatives": 100,
    "serving_resamples": 63,  # 64 reconstructions to rank by: about 64 times one's cost
    # exp(10 x bias): a bias spread of 2 already makes the likeliest item e^20 times likelier.
    "negative_popularity": 10.0,
}


# central_only_items travels in every assignment: a bound on its length keeps that small.
MAX_CENTRAL_ONLY_ITEMS = 100_000


class LocalState(enum.StrEnum):
    """What becomes of a device's local parameters between rounds."""

    RECONSTRUCT = "reconstruct"  # FedRecon: fitted afresh on the support set each task, then discarded
    KEEP = "keep"  # FURL: kept on the device across rounds, trained jointly with the globals


_ENUM_FIELDS = ("SplitPolicy", "LocalState")


@dataclass(frozen=True)
class TaskConfig:
    """What the server asks a device to do; defaults follow the FedRecon MovieLens protocol.

    Every number is checked against `TASK_CONFIG_MAXIMA` (on the server when a population is
    created, and on the device when an assignment arrives)."""

    split: SplitPolicy = SplitPolicy.ALTERNATE
    reuse_below: int = 0  # fewer examples than this: reuse all for support and query (deployment lesson)
    min_examples: int = 1
    max_examples: int = 300
    shuffle_seed: int | None = 42  # None keeps the store's order (newest first)
    reconstruction_learning_rate: float = 0.1
    reconstruction_max_epochs: int = 5
    reconstruction_max_steps: int = 50
    update_learning_rate: float = 0.5
    update_max_epochs: int = 1
    update_max_steps: int = 50
    l2_global: float = 0.0
    l2_local: float = 0.0
    negatives_per_positive: int = 4  # implicit feedback: sampled non-shared items per share
    # Implicit feedback: the negatives per share that reconstruction (the support set, and serving)
    # fits the locals against; None: negatives_per_positive, as the update.
    reconstruction_negatives: int | None = None
    # A ranking model, when a device serves: the reconstructions on bootstrap resamples of its
    # examples (drawn with replacement, as many) added to the one from every example; it ranks by
    # their softmax probabilities over the catalog, averaged. 0: the one reconstruction.
    serving_resamples: int = 0
    # Implicit feedback: negatives drawn in proportion to exp(this x the model's popularity global,
    # e.g. item biases), and ranking adds this x popularity back (logQ correction); 0: uniform.
    negative_popularity: float = 0.0
    # Implicit feedback, mixing centralized data: catalog rows only the centralized data holds (e.g.
    # items released after the devices' data). A device never draws them as negatives for its own
    # shares: it could not have shared them, so its not sharing them says nothing about its taste,
    # and hundreds of devices a round would push them down against the few centralized examples
    # that hold them. The centralized examples (example transfer, the server's central training)
    # still contrast against them.
    central_only_items: tuple[int, ...] = ()
    local_state: LocalState = LocalState.RECONSTRUCT
    local_learning_rate: float = 0.0  # locals train jointly during the update at this rate (FURL)
    clip_norm: float | None = None  # DP-FedAvg: the whole delta is clipped to this L2 norm before reporting
    # Adaptive clipping: also report whether the delta was within clip_norm (metric dp_within_clip).
    # Only when asked: it is one bit about the update that the server would otherwise not see.
    report_within_clip: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.local_state, LocalState):
            # A plain string ("keep") is accepted; `is LocalState.KEEP` tests need the member.
            try:
                object.__setattr__(self, "local_state", LocalState(self.local_state))
            except ValueError:
                problems.append(
                    f"local_state must be one of {[k.value for k in LocalState]}, got {self.local_state!r}"
                )
        problems.extend(self._check_central_only_items())
        wrong_type = False
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "central_only_items":
                continue
            if f.type in _ENUM_FIELDS or (value is None and f.type.endswith("| None")):
                continue
            if f.type == "bool":
                if not isinstance(value, bool):
                    problems.append(f"{f.name} must be true or false, got {value!r}")
                    wrong_type = True
                continue
            is_int = f.type.startswith("int")
            kinds = (int,) if is_int else (int, float)
            highest = TASK_CONFIG_MAXIMA.get(f.name, INT32_MAX if is_int else FLOAT32_MAX)
            if isinstance(value, bool) or not isinstance(value, kinds):
                problems.append(f"{f.name} must be {f.type.split(' ')[0]}, got {value!r}")
                wrong_type = True
            elif isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{f.name} must be finite, got {value}")
            elif not 0 <= value <= highest:  # ints are exact here: 2**64 must not round to a float
                problems.append(f"{f.name} must be in [0, {_shown(highest)}], got {_shown(value)}")
        if wrong_type:  # the rules below compare numbers: text or null would not compare
            raise ValueError("invalid task config: " + "; ".join(problems))
        if self.clip_norm == 0:
            problems.append(f"clip_norm must be > 0 (or null for no clipping), got {self.clip_norm}")
        if self.min_examples < 1:
            problems.append(f"min_examples must be >= 1, got {self.min_examples}")
        if self.max_examples < self.min_examples:
            problems.append(
                f"max_examples ({self.max_examples}) must be >= min_examples ({self.min_examples})"
            )
        if self.local_state is LocalState.KEEP and not self.local_learning_rate > 0:
            problems.append(
                "local_state 'keep' needs local_learning_rate > 0: kept locals train only during the update"
            )
        if problems:
            raise ValueError("invalid task config: " + "; ".join(problems))

    def _check_central_only_items(self) -> list[str]:
        items = self.central_only_items
        if not isinstance(items, (list, tuple)):
            return [f"central_only_items must be a list of catalog rows, got {type(items).__name__}"]
        bad = [i for i in items if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= INT32_MAX]
        if bad:
            return [f"central_only_items must be catalog rows (integers >= 0), got {bad[0]!r}"]
        if len(items) > MAX_CENTRAL_ONLY_ITEMS:
            return [f"central_only_items may list at most {MAX_CENTRAL_ONLY_ITEMS} rows, got {len(items)}"]
        # A sorted tuple of distinct rows: hashable, and one JSON form for one set.
        object.__setattr__(self, "central_only_items", tuple(sorted(set(items))))
        return []

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["central_only_items"] = list(self.central_only_items)
        data["split"] = self.split.value
        data["local_state"] = self.local_state.value
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TaskConfig:
        if not isinstance(data, Mapping):
            raise ValueError(f"a task config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown task config fields {sorted(unknown)}; known: {sorted(known)}")
        values = dict(data)
        for name, kind in (("split", SplitPolicy), ("local_state", LocalState)):
            if name in values:
                try:
                    values[name] = kind(values[name])
                except ValueError:
                    raise ValueError(
                        f"invalid task config: {name} must be one of {[k.value for k in kind]}, "
                        f"got {values[name]!r}"
                    ) from None
        return cls(**values)

    @classmethod
    def from_manifest(cls, manifest: Manifest, **overrides: Any) -> TaskConfig:
        """Defaults recorded at export, then `overrides`."""
        known = {f.name for f in fields(cls)}
        defaults = {k: v for k, v in manifest.training_defaults.items() if k in known}
        return cls.from_json({**defaults, **overrides})


def _shown(value: float) -> str:
    """A number for an error message: a huge integer as its power of two, not 400 digits."""
    if isinstance(value, int) and abs(value) >= 10**15:
        return f"{'-' if value < 0 else ''}~2^{abs(value).bit_length() - 1}"
    return f"{value:g}" if isinstance(value, float) else str(value)
