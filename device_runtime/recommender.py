"""On-device inference with reconstructed, cached local parameters: top-k recommendations from a
ranking model (`Recommender`, in a context such as the hour for a model that takes one), and
predictions from a classification or regression model (`Predictor`).

Inference in FedRecon reconstructs the user's local parameters from the device's own
examples with the latest global parameters. That costs a reconstruction, so the result is
cached (in memory, and in the store's private `local_state` table across restarts) under
a key of (global parameters, store revision) and refreshed only when either changes.
A device of a stateful population (FURL, `local_state: keep`) serves from the locals it
kept from training instead, once it has trained; until then it reconstructs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
from safetensors import SafetensorError

from contracts.features import Examples
from contracts.params import Params, ParamsError, decode_params, encode_params
from contracts.task_config import TaskConfig
from device_runtime.example_store import ExampleStoreError
from device_runtime.local_state import LocalStateStore
from device_runtime.task_environment import DeviceStore
from device_runtime.task_examples import select_examples
from model_runtime.support_query import (
    add_negatives,
    logq_correction,
    negative_weights,
    not_negatives,
    num_steps,
    shares,
    support_negatives,
)
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import TFLiteModel

_CACHE_KEY = "recommender.local_params"


@dataclass(frozen=True)
class Recommendation:
    items: np.ndarray  # best first
    scores: np.ndarray
    source: str  # "personalized" | "popularity" | "unavailable"
    message: str = ""
    # personalized from "kept" (FURL), "reconstructed", "bagged" (`Bagging`) or "no" local parameters
    local_params: str = ""


def params_fingerprint(params: Params) -> str:
    digest = hashlib.sha256()
    for name in sorted(params):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(params[name]).data)  # the buffer itself, no 4 MB copy
    return digest.hexdigest()


AVERAGES = ("probabilities", "scores")
MAX_MEMBERS = 64


@dataclass(frozen=True)
class Bagging:
    """Serving from several reconstructions (a bagged, bootstrap reconstruction): the user's
    locals are reconstructed `members` times, each on a bootstrap resample of the device's own
    examples (drawn with replacement, as many as there are; `resample` false: the examples
    themselves, each member with its own negatives), and the catalog is ranked by the average of
    the members' softmax probabilities over the catalog (`average` "scores": of their scores).
    `include_full`: the first member is the plain reconstruction from every example (so one
    member with it is plain serving). The draws are seeded by `seed` and the store's revision,
    as the plain reconstruction's negatives are by the revision: the same store ranks the same."""

    members: int = 8
    resample: bool = True
    include_full: bool = False
    average: str = "probabilities"
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                problems.append(f"{f.name} must be true or false, got {value!r}")
            elif f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                problems.append(f"{f.name} must be an integer, got {value!r}")
        if not problems:
            if not 1 <= self.members <= MAX_MEMBERS:
                problems.append(f"members must be in [1, {MAX_MEMBERS}], got {self.members}")
            if not 0 <= self.seed < 2**32:
                problems.append(f"seed must be in [0, 2**32), got {self.seed}")
        if self.average not in AVERAGES:
            problems.append(f"average must be one of {list(AVERAGES)}, got {self.average!r}")
        if problems:
            raise ValueError("invalid serving bagging: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Bagging:
        if not isinstance(data, Mapping):
            raise ValueError(f"serving bagging must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown serving bagging fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)


def average_members(member_scores: list[np.ndarray], average: str) -> np.ndarray:
    """One ranking from the members' scores over the catalog: the log of the mean of their softmax
    probabilities ("probabilities"), or the mean of the scores themselves ("scores")."""
    stacked = np.stack([np.asarray(s, np.float64) for s in member_scores])
    if average == "scores":
        mean: np.ndarray = stacked.mean(axis=0)
        return mean
    shifted = stacked - stacked.max(axis=1, keepdims=True)
    probabilities = np.exp(shifted)
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        logged: np.ndarray = np.log(probabilities.mean(axis=0))
    return logged


class WrongTask(ValueError):
    """The model's task is not the one asked of it (e.g. top-k items from a regression model)."""


class PersonalModel:
    """A model with this device's user's local parameters (kept or reconstructed, cached)."""

    def __init__(
        self,
        model: TFLiteModel,
        store: DeviceStore,
        global_params: Params,
        config: TaskConfig | None = None,
        *,
        global_version: str | None = None,
        kept: LocalStateStore | None = None,
    ) -> None:
        """`kept`: the device's kept locals (a stateful population), served from once trained.
        A store whose examples do not fit the model is an `ExampleStoreError`."""
        mismatch = store.mismatch(model.manifest.features)
        if mismatch is not None:
            raise ExampleStoreError(mismatch)
        self.model = model
        self.store = store
        self.kept = kept
        self.config = config or TaskConfig.from_manifest(model.manifest, shuffle_seed=None)
        self._used: tuple[int, np.ndarray] | None = None
        self._loaded_key: str | None = None
        self.set_global(global_params, version=global_version)

    def set_global(self, params: Params, *, version: str | None = None) -> None:
        """Install new global parameters (e.g. after a round); the local cache goes stale."""
        self.model.set_global(params)
        popularity = self.model.manifest.task.popularity
        self._popularity_scores = None if popularity is None else params[popularity]
        self._negative_weights = negative_weights(self.model.manifest, self.config, params)
        self._correction = logq_correction(self.model.manifest, self.config, params)
        self._global_version = version or params_fingerprint(params)
        self._loaded_key = None

    def _cache_key(self, revision: int) -> str:
        # The task config too: another population's (or a changed) reconstruction gives other locals.
        task = hashlib.sha256(json.dumps(self.config.to_json(), sort_keys=True).encode()).hexdigest()[:16]
        return json.dumps([self.model.manifest.model_sha256, self._global_version, revision, task])

    def _ensure_local(self, revision: int) -> str:
        """Make the interpreter hold this device's local parameters: the kept ones when there are
        trained ones, else reconstructed for this store revision and these globals; says which."""
        if not self.model.manifest.local_params:
            return "no"  # plain FedAvg: every device ranks with the globals alone
        if self.kept is not None:
            kept = self.kept.load(self.model)
            if kept.trained:
                # Read each time: the next training task may have replaced them (a few hundred bytes).
                self.model.set_local(kept.params)
                self._loaded_key = None
                return "kept"
        key = self._cache_key(revision)
        if self._loaded_key == key:
            return "reconstructed"
        stored = self.store.load_local_state(_CACHE_KEY)
        if stored is not None:
            cached = self._decode_cache(stored, key)
            if cached is not None:
                self.model.set_local(cached)
                self._loaded_key = key
                return "reconstructed"
        examples, _ = select_examples(self.store, self.model.manifest, self.config)
        # Seeded by the revision, so a cached reconstruction is the one this store would give again.
        local = self._reconstructed(examples, np.random.default_rng(revision), not_negatives(self.config))
        # One row holds the key and the tensors, so they can never disagree.
        self.store.save_local_state(_CACHE_KEY, key.encode() + b"\n" + encode_params(local))
        self._loaded_key = key
        return "reconstructed"

    def _reconstructed(
        self, examples: Examples, rng: np.random.Generator, also_shared: np.ndarray | None
    ) -> Params:
        """The locals reconstructed from `examples` (the model's `reconstruct`), with the task's
        support negatives drawn by `rng` (never one of `also_shared`); leaves the interpreter
        holding them."""
        manifest = self.model.manifest
        negatives = support_negatives(self.config)
        if manifest.task.negative_sampling and negatives:
            # Reconstruct as training does: from shares alone every item looks liked, and the user
            # vector drifts toward whatever is popular.
            examples = add_negatives(examples, manifest, negatives, rng, also_shared, self._negative_weights)
        batches = split_batches(examples, manifest.batch_size)[: manifest.max_batches]
        support = TaskBatches.pack(batches, manifest)
        self.model.reset_local()
        steps = num_steps(
            support.num_batches, self.config.reconstruction_max_epochs, self.config.reconstruction_max_steps
        )
        self.model.reconstruct(support, steps, self.config.reconstruction_learning_rate, self.config.l2_local)
        return self.model.get_local()

    def _serves_kept(self) -> bool:
        return self.kept is not None and self.kept.load(self.model).trained

    def _decode_cache(self, blob: bytes, key: str) -> Params | None:
        stored_key, _, tensors = blob.partition(b"\n")
        if stored_key != key.encode():
            return None
        try:
            return decode_params(tensors, self.model.manifest.local_params, "cached local parameters")
        except (ParamsError, SafetensorError):
            return None  # a damaged cache is rebuilt, never trusted


class Recommender(PersonalModel):
    """Top-k items (e.g. expressions) for this device's user, in a context for a model with one."""

    def __init__(
        self,
        model: TFLiteModel,
        store: DeviceStore,
        global_params: Params,
        config: TaskConfig | None = None,
        *,
        global_version: str | None = None,
        kept: LocalStateStore | None = None,
        bagging: Bagging | None = None,
    ) -> None:
        """`bagging`: rank by several reconstructions on resamples of the examples (`Bagging`);
        None (the default): as the task config's `serving_resamples` says (0: by the one
        reconstruction). A device serving kept locals (FURL, once trained) ranks with them."""
        task = model.manifest.task
        if task.kind != "ranking" or task.catalog_feature is None:
            raise WrongTask(
                f"a recommender needs a model that ranks a catalog; this model's task is {task.kind!r} "
                "(its predictions come from `predict`)"
            )
        self.catalog = task.catalog_feature
        self._members: tuple[str, list[Params]] | None = None
        super().__init__(model, store, global_params, config, global_version=global_version, kept=kept)
        if bagging is None and self.config.serving_resamples:
            # The task config's serving: the reconstruction from every example and the resamples'.
            bagging = Bagging(members=1 + self.config.serving_resamples, include_full=True)
        self.bagging = bagging

    def _used_items(self, revision: int) -> np.ndarray:
        if self._used is None or self._used[0] != revision:
            self._used = (revision, self.store.distinct_values(self.catalog))
        return self._used[1]

    def recommend(
        self,
        k: int = 10,
        *,
        exclude: Iterable[int] = (),
        exclude_used: bool = True,
        context: Mapping[str, Any] | None = None,
    ) -> Recommendation:
        """The `k` best items, leaving out `exclude` and (by default) what the user already used;
        `context`: one value per context feature of a model that has them (e.g. `{"hour": 21}`)."""
        values = self.model.checked_context(context or {})  # wrong context: a ValueError, first
        n = self.model.manifest.catalog_size
        if not 1 <= k <= n:
            raise ValueError(f"k must be in [1, {n}], got {k}")
        mask = np.zeros(n, dtype=bool)
        excluded = np.fromiter(exclude, dtype=np.int64)
        if excluded.size and (excluded.min() < 0 or excluded.max() >= n):
            raise ValueError(f"excluded item ids must be in [0, {n})")
        mask[excluded] = True
        revision = self.store.revision
        if exclude_used:
            used = self._used_items(revision)
            mask[used[(used >= 0) & (used < n)]] = True
        if self.store.count() == 0:
            return self._popularity(k, mask, values)
        if self.bagging is not None and self.model.manifest.local_params and not self._serves_kept():
            logits = self._bagged_scores(self.bagging, revision, values)
            scores_all = np.where(mask, -np.inf, logits)
            items = np.argsort(-scores_all, kind="stable")[:k].astype(np.int32)
            keep = ~mask[items]
            return Recommendation(
                items[keep], scores_all[items][keep].astype(np.float32), "personalized", local_params="bagged"
            )
        local_params = self._ensure_local(revision)
        if k <= self.model.manifest.task.top_k and self._correction is None:
            ranking = self.model.infer(mask, values)
            items, scores = ranking.top_items[:k], ranking.top_scores[:k]
        else:
            # Negatives drawn by popularity: the model's logits lack log q, added back here
            # (`infer` returns every row's score, so the signature needs no input for it).
            logits = self.model.infer(context=values).scores
            if self._correction is not None:
                logits = logits + self._correction
            scores_all = np.where(mask, -np.inf, logits)
            items = np.argsort(-scores_all, kind="stable")[:k].astype(np.int32)
            scores = scores_all[items]
        keep = ~mask[items]  # fewer than k items left after exclusions
        return Recommendation(items[keep], scores[keep], "personalized", local_params=local_params)

    def _bagged_scores(self, bagging: Bagging, revision: int, context: dict[str, np.ndarray]) -> np.ndarray:
        """The members' scores over the catalog (logQ-corrected as plain serving's), averaged."""
        members = self._bagged_locals(bagging, revision)
        scores = []
        for local in members:
            self.model.set_local(local)
            logits = self.model.infer(context=context).scores
            scores.append(logits if self._correction is None else logits + self._correction)
        self._loaded_key = None  # the interpreter holds the last member's locals, not the cached ones
        return average_members(scores, bagging.average)

    def _bagged_locals(self, bagging: Bagging, revision: int) -> list[Params]:
        """The members' locals for this store revision and these globals (kept in memory)."""
        key = json.dumps([self._cache_key(revision), bagging.to_json()])
        if self._members is not None and self._members[0] == key:
            return self._members[1]
        manifest = self.model.manifest
        examples, _ = select_examples(self.store, manifest, self.config)
        members = []
        if bagging.include_full:
            members.append(
                self._reconstructed(examples, np.random.default_rng(revision), not_negatives(self.config))
            )
        # A resample leaves some shares out: they are still the user's, never its negatives.
        also_shared = not_negatives(
            self.config, shares(examples, manifest) if manifest.task.negative_sampling else None
        )
        n = examples.num_examples
        for m in range(len(members), bagging.members):
            rng = np.random.default_rng([bagging.seed, revision, m])
            picked = examples.select(rng.integers(0, n, n)) if bagging.resample else examples
            members.append(self._reconstructed(picked, rng, also_shared))
        self._members = (key, members)
        return members

    def _popularity(self, k: int, mask: np.ndarray, context: dict[str, np.ndarray]) -> Recommendation:
        """No examples yet: rank as the model does for a user it knows nothing about, i.e. its scores
        with the initial locals (for MF, each item's bias plus its topic's, which learn popularity)."""
        if self._popularity_scores is None:
            return Recommendation(
                np.zeros(0, np.int32),
                np.zeros(0, np.float32),
                "unavailable",
                "no local examples and the model has no popularity parameter (e.g. item biases) to rank by",
            )
        logits = cold_start_scores(self.model, context, self._correction)
        self._loaded_key = None  # the interpreter now holds the initial locals, not a cached user's
        scores = np.where(mask, -np.inf, logits)
        items = np.argsort(-scores, kind="stable")[:k]
        items = items[~mask[items]]
        return Recommendation(items.astype(np.int32), logits[items], "popularity")


def cold_start_scores(
    model: TFLiteModel, context: Mapping[str, Any] | None = None, correction: np.ndarray | None = None
) -> np.ndarray:
    """A ranking model's scores over its catalog for a user with no examples: `infer` with the
    model's initial (exported) locals and its installed globals, plus the logQ `correction` of
    popularity-drawn negatives when given. Leaves the interpreter holding the initial locals."""
    model.reset_local()
    logits = model.infer(context=context).scores
    return logits if correction is None else logits + correction


class Predictor(PersonalModel):
    """A classification or regression model's outputs for examples, with this user's locals."""

    def __init__(
        self,
        model: TFLiteModel,
        store: DeviceStore,
        global_params: Params,
        config: TaskConfig | None = None,
        *,
        global_version: str | None = None,
        kept: LocalStateStore | None = None,
    ) -> None:
        if model.manifest.task.kind == "ranking":
            raise WrongTask("a ranking model ranks its catalog: its top-k items come from `recommend`")
        super().__init__(model, store, global_params, config, global_version=global_version, kept=kept)

    def predict(self, examples: Examples) -> Prediction:
        """`infer`'s outputs per example (`top_classes`/`top_scores`, or `predictions`); the
        locals are this user's (kept, or reconstructed from the store; none without examples)."""
        if self.store.count():
            local_params = self._ensure_local(self.store.revision)
        else:
            self.model.reset_local()  # nothing to reconstruct from: the model's initial locals
            local_params, self._loaded_key = "initial", None
        return Prediction(self.model.predict(examples), local_params)


@dataclass(frozen=True)
class Prediction:
    outputs: dict[str, np.ndarray]  # per example: `top_classes` and `top_scores`, or `predictions`
    local_params: str  # "kept", "reconstructed", "no" (the model has none) or "initial" (no examples)
