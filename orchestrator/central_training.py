"""Parallel training (Algorithm 2 of Augenstein et al., "Mixing centralized and federated data"):
the server trains a copy of the global parameters on the centralized data and merges its delta
with the federated one (MERGEOPT) before the server optimizer.

The server runs the same exported model's signatures as the devices, through the same TFLite
interpreter (model_runtime): no second implementation of the model's maths, and no TensorFlow.

The central delta depends only on the round's base parameters, not on its reports: it is computed
in a background thread as soon as a commit has made the next base version, so that the commit of
the next round (which on SQLite runs on the event loop) only merges it. A commit that finds none
(the population's first round, a restarted process, another server process) computes it inline;
both give the same delta (seeded by the base version).

Gradient transfer (Algorithm 4) uses the same pseudo-users and interpreters: the gradient of the
centralized loss at a version's globals, computed once per version (in the background after the
commit that made it, or by the first assignment that asks) and served to every assignment of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contracts.features import Examples
from contracts.manifest import MANIFEST_FILE, MODEL_FILE, Manifest, ManifestError
from contracts.mixing import CentralDataset, MixingConfig
from contracts.params import Params, SparseTensor, row_shape
from contracts.task_config import SplitPolicy, TaskConfig
from model_runtime.support_query import (
    add_negatives,
    negative_weights,
    num_steps,
    reconstruct_locals,
    split_support_query,
)
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import ModelLoadError, SparseGradient, TFLiteModel
from orchestrator.populations.model_check import described


class CentralTrainingError(RuntimeError):
    """Training on the centralized data diverged (non-finite loss or delta)."""


class ModelUnavailable(CentralTrainingError):
    """The population's model does not load here (a population made before models were checked
    at creation, or a damaged copy): no central delta or gradient, said as such, never a 500."""


@dataclass(frozen=True)
class CentralUpdate:
    delta: Params  # dense, one tensor per global parameter
    loss: float  # mean batch loss over the update calls
    steps: int  # J


def pseudo_user_capacity(manifest: Manifest, task: TaskConfig) -> int:
    """The most examples a pseudo-user holds with every one of them used: with its sampled
    negatives (implicit labels), its support batches fit one `reconstruct` call and are all
    stepped through, and so are its query batches in `update` (and `gradient`).

    Measured for the fleet's implicit model (batch 8, max_batches 64, 4 negatives a share, at most
    50 reconstruction and 50 update steps): 160 shares -> 800 examples -> 100 batches, 50 support
    and 50 query, each visited. The former default, one update call's worth (512 shares), made
    2,560 examples, of which one call took 64 + 64 batches (1,024, 40%) and the 50 + 50 steps
    visited 800 (31%) (tests/orchestrator/test_mixing.py measures both).
    """
    per_example = 1 + task.negatives_per_positive if manifest.task.negative_sampling else 1
    # A half's batches are all visited when they fit a call and the steps (epochs >= 1).
    steps = (
        task.update_max_steps
        if not manifest.local_params
        else min(task.reconstruction_max_steps, task.update_max_steps)
    )
    half = min(manifest.max_batches, steps) * manifest.batch_size
    split = manifest.local_params and task.split is SplitPolicy.ALTERNATE
    # A group below `reuse_below` is used whole for both halves: it must fit one half then.
    if split and task.reuse_below <= half:
        return max(1, 2 * half // per_example)
    return max(1, half // per_example)


def groups_of(
    examples: Examples,
    manifest: Manifest,
    task: TaskConfig,
    size: int | None = None,
    groups: np.ndarray | None = None,
) -> list[Examples]:
    """The centralized examples as pseudo-users. With `groups` (the dataset's group ids, e.g. the
    public account of each example): one pseudo-user per group in id order, its examples in
    dataset order, a group larger than `pseudo_user_capacity` split into near-equal parts. Without:
    consecutive runs of `size` examples (default: the capacity).

    A FedRecon model's update needs local parameters fitted to the examples it trains on. The
    whole dataset as one pseudo-user would fit one user embedding to everyone's examples; one
    group per example would reconstruct from nothing. A group spanning dozens of accounts loses
    most of what the centralized data could teach (README, "Mixing centralized data: the skewed
    setup"): group ids make each pseudo-user one account.
    """
    capacity = pseudo_user_capacity(manifest, task)
    if not examples.num_examples:
        return []
    if groups is None:
        if size is not None and size < 1:
            raise ValueError(f"a pseudo-user holds at least 1 example, got {size}")
        # Checked against the task when attached; the population's task may have changed since.
        return split_batches(examples, min(size or capacity, capacity))
    if groups.shape != (examples.num_examples,):
        raise ValueError(f"one group id per example expected, got shape {list(groups.shape)}")
    order = np.argsort(groups, kind="stable")
    starts = np.flatnonzero(np.diff(groups[order], prepend=-1))
    pseudo_users = []
    for members in np.split(order, starts[1:]):
        for part in np.array_split(members, -(-len(members) // capacity)):
            pseudo_users.append(examples.select(part))
    return pseudo_users


def pseudo_user_batches(
    manifest: Manifest,
    group: Examples,
    task: TaskConfig,
    rng: np.random.Generator,
    weights: np.ndarray | None = None,
) -> tuple[list[Examples], list[Examples]]:
    """A group as a device would take it: negatives added (implicit labels, drawn by `weights`,
    `negative_weights`), then split into support and query batches."""
    if manifest.task.negative_sampling and task.negatives_per_positive:
        group = add_negatives(group, manifest, task.negatives_per_positive, rng, weights=weights)
    return split_support_query(group, manifest, task)


def train_on_central(
    model: TFLiteModel,
    global_params: Params,
    dataset: CentralDataset,
    mixing: MixingConfig,
    task: TaskConfig,
    seed: int,
) -> CentralUpdate:
    """J = `mixing.central_steps` update steps from `global_params` over the centralized examples,
    group by group (reconstruct the locals on a group's support half, then update the globals on
    its query half, as a device does), from a group order fixed by `seed`; the delta of the globals.
    """
    manifest = model.manifest
    groups = groups_of(dataset.examples, manifest, task, mixing.examples_per_pseudo_user, dataset.groups)
    if not groups:
        raise ValueError("parallel training needs centralized examples; none are attached")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(groups))
    # Negatives drawn as the round's devices draw them: by the round's globals.
    weights = negative_weights(manifest, task, global_params)
    params = {k: np.array(v, np.float32, copy=True) for k, v in global_params.items()}
    steps_left, losses, turn = mixing.central_steps, [], 0
    try:
        while steps_left > 0:
            group = groups[order[turn % len(groups)]]
            turn += 1
            batches = _as_pseudo_user(model, params, group, task, rng, weights)
            steps = min(
                steps_left, num_steps(batches.num_batches, task.update_max_epochs, task.update_max_steps)
            )
            if steps <= 0:
                break
            update = model.update(
                batches, steps, mixing.central_learning_rate, l2_global=task.l2_global, l2_local=task.l2_local
            )
            # tflite_runtime saturates an overflow at float32's maximum where LiteRT gives inf/NaN.
            if not (np.isfinite(update.loss) and update.max_abs_change < 1e30):
                raise CentralTrainingError(
                    "training on the centralized data diverged (non-finite delta); "
                    "lower central_learning_rate"
                )
            params = {k: params[k] + update.delta[k] for k in params}
            losses.append(update.loss)
            steps_left -= steps
    finally:
        model.reset_local()
    delta = {k: (params[k] - global_params[k]).astype(np.float32) for k in params}
    return CentralUpdate(
        delta, float(np.mean(losses)) if losses else float("nan"), mixing.central_steps - steps_left
    )


def _as_pseudo_user(
    model: TFLiteModel,
    params: Params,
    group: Examples,
    task: TaskConfig,
    rng: np.random.Generator,
    weights: np.ndarray | None,
) -> TaskBatches:
    """A group as a device would take it: negatives added (implicit labels), the globals set to
    `params`, the locals reconstructed on its support half; its query half's batches."""
    manifest = model.manifest
    support, query = pseudo_user_batches(manifest, group, task, rng, weights)
    model.set_global(params)
    if manifest.local_params:
        reconstruct_locals(model, TaskBatches.pack(support, manifest), task)
    return TaskBatches.pack(query, manifest)


@dataclass(frozen=True)
class CentralGradient:
    gradient: SparseGradient  # every global; a row-sparse one: the rows the centralized data touches
    loss: float  # the example-weighted mean data loss


def gradient_on_central(
    model: TFLiteModel,
    global_params: Params,
    dataset: CentralDataset,
    task: TaskConfig,
    seed: int,
    examples_per_pseudo_user: int | None = None,
) -> CentralGradient:
    """Gradient transfer (Algorithm 4): the gradient of the centralized data's loss at
    `global_params`, through the model's `gradient` signature: each group (pseudo-user, as in
    `train_on_central`) with its locals reconstructed, the groups' gradients weighted by their
    examples' weight. Negatives (implicit labels) are drawn from `seed`."""
    manifest = model.manifest
    groups = groups_of(dataset.examples, manifest, task, examples_per_pseudo_user, dataset.groups)
    if not groups:
        raise ValueError("gradient transfer needs centralized examples; none are attached")
    rng = np.random.default_rng(seed)
    weights = negative_weights(manifest, task, global_params)
    sums = {s.name: np.zeros(row_shape(s.shape), np.float64) for s in manifest.global_params}
    touched = {s.name: np.zeros(row_shape(s.shape)[0], bool) for s in manifest.global_params}
    total, loss = 0.0, 0.0
    try:
        for group in groups:
            result = model.gradient(_as_pseudo_user(model, global_params, group, task, rng, weights))
            for name, tensor in result.gradient.items():
                sums[name][tensor.rows] += np.asarray(tensor.values, np.float64) * result.weight_sum
                touched[name][tensor.rows] = True
            total += result.weight_sum
            loss += result.loss * result.weight_sum
    finally:
        model.reset_local()
    if total <= 0:
        raise ValueError("the centralized examples carry no weight; gradient transfer has nothing to send")
    gradient: SparseGradient = {}
    for spec in manifest.global_params:
        rows = np.flatnonzero(touched[spec.name]).astype(np.int32)
        values = (sums[spec.name][rows] / total).astype(np.float32)
        if not np.all(np.isfinite(values)):
            raise CentralTrainingError("the centralized data's gradient is not finite at this model version")
        gradient[spec.name] = SparseTensor(spec.shape, rows, values)
    return CentralGradient(gradient, loss / total)


def merge(federated: Params, central: Params, alpha: float) -> Params:
    """MERGEOPT: `(1 - alpha) * federated + alpha * central`, per tensor (float64 sums)."""
    if federated.keys() != central.keys():
        raise ValueError(f"deltas of different tensors: {sorted(federated)} and {sorted(central)}")
    return {
        k: (
            (1.0 - alpha) * np.asarray(federated[k], np.float64) + alpha * np.asarray(central[k], np.float64)
        ).astype(np.float32)
        for k in federated
    }


# ---- the server's interpreters and the precomputed deltas --------------------------------------


class _ServerModels:
    """One TFLiteModel per exported model in this process, each used under its lock (an
    interpreter is not thread-safe). A model is loaded from files in a private directory that is
    removed once loaded (the interpreter holds the model's bytes), so a server leaves no files."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, tuple[TFLiteModel, threading.Lock]] = {}

    @contextlib.contextmanager
    def model(self, sha256: str, manifest: Manifest, tflite: bytes | None) -> Iterator[TFLiteModel]:
        with self._lock:
            if sha256 not in self._models:
                if tflite is None:
                    raise RuntimeError(f"model {sha256[:12]}... is not loaded and its file was not given")
                try:
                    with tempfile.TemporaryDirectory(prefix="orchestrator-model-") as tmp:
                        model_dir = Path(tmp)
                        (model_dir / MODEL_FILE).write_bytes(tflite)
                        (model_dir / MANIFEST_FILE).write_text(json.dumps(manifest.to_json()))
                        loaded = TFLiteModel(model_dir)
                except (ModelLoadError, ManifestError) as e:
                    raise ModelUnavailable(
                        f"the population's model cannot be loaded: {described(e)}"
                    ) from None
                self._models[sha256] = (loaded, threading.Lock())
            model, lock = self._models[sha256]
        with lock:
            yield model

    def loaded(self, sha256: str) -> bool:
        with self._lock:
            return sha256 in self._models


_models = _ServerModels()


def has_model(sha256: str) -> bool:
    """Whether this process has loaded the model (a job then need not carry its file)."""
    return _models.loaded(sha256)


_MAX_READY = 32
_ready: OrderedDict[tuple[object, ...], CentralUpdate | CentralTrainingError] = OrderedDict()
_ready_lock = threading.Lock()
_background = ThreadPoolExecutor(1, thread_name_prefix="central-training")


@dataclass(frozen=True)
class CentralJob:
    """Everything one central delta needs, gathered inside a transaction."""

    key: tuple[object, ...]
    artifact_sha256: str
    manifest: Manifest
    tflite: bytes | None  # the model file; None when this process has it loaded
    params: Params
    dataset: CentralDataset
    mixing: MixingConfig
    task: TaskConfig
    seed: int

    def run(self) -> CentralUpdate:
        with _models.model(self.artifact_sha256, self.manifest, self.tflite) as model:
            return train_on_central(model, self.params, self.dataset, self.mixing, self.task, self.seed)

    def gradient(self) -> CentralGradient:
        with _models.model(self.artifact_sha256, self.manifest, self.tflite) as model:
            return gradient_on_central(
                model, self.params, self.dataset, self.task, self.seed, self.mixing.examples_per_pseudo_user
            )


def job_key(
    database: object, population_id: int, version: int, dataset_sha256: str, mixing: MixingConfig
) -> tuple[object, ...]:
    config = hashlib.sha256(json.dumps(mixing.to_json(), sort_keys=True).encode()).hexdigest()
    return (id(database), population_id, version, dataset_sha256, config)


def central_update(job: CentralJob) -> CentralUpdate:
    """The job's delta: precomputed if its background run finished, else computed here."""
    with _ready_lock:
        found = _ready.pop(job.key, None)
    if isinstance(found, CentralTrainingError):
        raise found
    return found if found is not None else job.run()


def precompute(job: CentralJob) -> None:
    """Compute the job's delta in the background, for the commit that will need it."""

    def run() -> None:
        try:
            result: CentralUpdate | CentralTrainingError = job.run()
        except CentralTrainingError as e:
            result = e
        with _ready_lock:
            _ready[job.key] = result
            while len(_ready) > _MAX_READY:
                _ready.popitem(last=False)

    _background.submit(run)


# ---- gradient transfer's central gradient, one per model version -------------------------------

# Every assignment of a round downloads its version's gradient: kept (not popped) per job key.
_gradients: OrderedDict[tuple[object, ...], CentralGradient | CentralTrainingError] = OrderedDict()
# One computation at a time: the assignments that ask while it runs wait for it, not redo it.
_gradient_lock = threading.Lock()


def central_gradient(job: CentralJob) -> CentralGradient:
    """The central gradient at the job's version: cached, else computed here (once per version)."""
    with _gradient_lock:
        found = _gradients.get(job.key)
        if found is None:
            try:
                found = job.gradient()
            except CentralTrainingError as e:
                found = e
            _gradients[job.key] = found
            while len(_gradients) > _MAX_READY:
                _gradients.popitem(last=False)
    if isinstance(found, CentralTrainingError):
        raise found
    return found


def precompute_gradient(job: CentralJob) -> None:
    """Compute the next version's central gradient in the background, before its devices ask."""
    _background.submit(central_gradient, job)
