"""After training: held-out devices serve their own top-10 with the final model, on the device.

Each held-out device downloads the latest global parameters, reconstructs its user embedding
from its own store (`Recommender`), and ranks the catalog. For implicit data the device's
newest share was kept out of its store: a hit is that share landing in the top-10. Two
baselines: the model's global top-10 (item biases: what a device with no data is shown) and
the most-shared top-10 counted over the training devices' data, which only a server that
saw every share could compute.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.table import Table

from android_sim.bayes_ceiling import MAX_DEVICES, BayesCeiling, bayes_ceiling
from android_sim.ceilings import ceiling_tops, table_ceiling_tops
from android_sim.hit_rates import Evaluation, ScoredDevice, evaluate
from android_sim.intervals import Interval
from contracts.features import Examples
from contracts.manifest import Manifest
from contracts.params import Params, decode_params
from contracts.task_config import LocalState, TaskConfig
from device_runtime.example_store import ExampleStore
from device_runtime.local_state import LocalStateStore
from device_runtime.recommender import Bagging, Recommender, cold_start_scores
from model_runtime.support_query import logq_correction
from model_runtime.tflite_model import TFLiteModel

if TYPE_CHECKING:
    from android_sim.fleet import Fleet
    from android_sim.workload import Workload

K = 10


# The methods scored on every held-out device, in the order they are printed; * a ceiling
# (`android_sim.ceilings`): it needs every share on one server, or the generator's truth.
METHODS = {
    "personalized": "FedRecon",
    "global": "global (model)",
    "most_shared": "most-shared",
    "topic_rule": "topic rule *",
    "group_rule": "group rule *",
    "cooccurrence": "co-occurrence *",
    "central_mf": "central MF *",
    "bayes": "Bayes *",
    "oracle": "oracle *",
}
DESCRIBED = {
    "personalized": "FedRecon: the device's own top-10, its user embedding reconstructed on the device",
    "global": "the model without locals: what a device with no data is shown (in its context, if any)",
    "most_shared": "the ten expressions shared most on the training devices",
    "topic_rule": "ceiling: popularity x the device history's topics, re-share bonus (no training)",
    "group_rule": "ceiling: popularity x the device history's groups (the catalog's), re-share bonus",
    "cooccurrence": "ceiling: items shared by the same training devices as the history's, re-share bonus",
    "central_mf": "ceiling: softmax MF trained on every training device's shares pooled",
    "bayes": "ceiling: the posterior predictive given the history, under the generator's prior and items",
    "oracle": "ceiling: the generator's own share probabilities",
}


@dataclass(frozen=True)
class HitRates:
    """The held-out devices' hit rates@10 (`android_sim.hit_rates`) and each scored device's top-10s."""

    evaluation: Evaluation
    scored: list[ScoredDevice]
    # What "personalized" was, as the tables name it: FedRecon, FURL, or a model without locals.
    model_label: str = "FedRecon"
    bayes: BayesCeiling | None = None  # how the Bayes ceiling's row was estimated (synthetic data)

    @property
    def devices(self) -> int:
        return self.evaluation.devices

    def figure(self, method: str, kind: str = "expected") -> Interval | None:
        """A method's hit rate over every scored device: "expected" (under the ground truth) or "newest"."""
        score = self.evaluation.methods.get(method)
        return None if score is None else score.expected if kind == "expected" else score.newest

    @property
    def headline(self) -> str:
        """The figure a run leads with: the expected hit rate where there is ground truth."""
        return "expected" if self.figure("personalized", "expected") is not None else "newest"

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self.evaluation),
            "methods_described": {
                m: DESCRIBED[m].replace("FedRecon", self.model_label, 1) for m in self.evaluation.methods
            },
            "model_label": self.model_label,
            "future_fraction": "newest fifth of each held-out device's shares, at least one, never all",
            "scored_devices": [d.to_json() for d in self.scored],
            "bayes_ceiling": None if self.bayes is None else self.bayes.to_json(),
        }


def catalog(model: TFLiteModel) -> str:
    name = model.manifest.task.catalog_feature
    assert name is not None, "a ranking model names its catalog feature"
    return name


def context_of(model: TFLiteModel, examples: Examples) -> dict[str, Any] | None:
    """A model with context features (e.g. the hour) ranks in one context: that of the first of
    `examples` (the share to come, or the newest); None for a model without context."""
    features = model.manifest.context_features
    if not features or not examples.num_examples:
        return None
    return {f.name: examples[f.name][0] for f in features}


def popularity_top(model: TFLiteModel, params: Params) -> np.ndarray:
    """The model's global top-k: what a device with no data is shown (`Recommender`'s cold start:
    the scores with the initial locals), none without a popularity. A model that ranks in a context
    shows each context its own; this is the popularity global's order."""
    popularity = model.manifest.task.popularity
    if popularity is None or popularity not in params:
        return np.zeros(0, np.int64)
    if model.manifest.context_features:
        return np.argsort(-params[popularity], kind="stable")[:K]
    model.set_global(params)
    return np.argsort(-cold_start_scores(model), kind="stable")[:K]


def shares_by_item(workload: Workload, training: list[int]) -> np.ndarray:
    """How often each catalog row was shared (a positive label) on the training devices: what
    only a server that saw every device's data could count."""
    found = [training_shares(workload, i) for i in training]
    return np.bincount(
        np.concatenate([*found, np.zeros(0, np.int64)]), minlength=workload.manifest.catalog_size
    )


async def held_out_hit_rates(
    fleet: Fleet,
    future: dict[int, Examples],
    population: str,
    status: dict[str, Any],
    workload: Workload,
    show: int,
) -> tuple[HitRates | None, list[dict[str, Any]]]:
    held_out = [d for d in fleet.devices if d.role != "training" and d.device_id]
    if not held_out:
        return None, []
    client = held_out[0].client
    model_dir = await client.population_model(population, status["artifact_sha256"], fleet.cache_dir)
    blob = await client.global_params_at(population, int(status["current_version"]))
    model = TFLiteModel(model_dir)
    params = decode_params(blob, model.manifest.global_params, "global parameters")
    training = [d.index for d in fleet.devices if d.role == "training"]
    return await asyncio.to_thread(
        score_held_out,
        model,
        params,
        str(status["current_version"]),
        held_out,
        future,
        workload,
        training,
        show,
        # A device serves as it trains: the population's reconstruction (rate, steps, negatives,
        # popularity correction), not the export's defaults.
        await client.task_config(population),
    )


def score_held_out(
    model: TFLiteModel,
    params: Params,
    version: str,
    held_out: list[Any],
    future: dict[int, Examples],
    workload: Workload,
    training: list[int],
    show: int,
    task: TaskConfig,
    bagging: Bagging | None = None,
    item_groups: np.ndarray | None = None,
    ceilings: bool = True,
) -> tuple[HitRates | None, list[dict[str, Any]]]:
    """Each held-out device's top-10s (its own, on the device, with `params` and the population's
    `task`, ranked by a bagged reconstruction with `bagging`; the baselines'; the
    ceilings: with the data's ground truth, else the table's, with the group rule over
    `item_groups` when given; none without `ceilings`) scored against its kept-aside shares
    `future`; and the first `show` devices' tables to print."""
    global_top = popularity_top(model, params)
    correction = logq_correction(model.manifest, task, params)
    counts = shares_by_item(workload, training)
    most_shared = np.argsort(-counts, kind="stable")[:K]
    name = catalog(model)
    devices: list[dict[str, Any]] = []
    examples: list[dict[str, Any]] = []
    for device in held_out:
        coming = future.get(device.index)
        with ExampleStore(device.store_path) as store:
            recommender = Recommender(model, store, params, task, global_version=version, bagging=bagging)
            newest = store.examples()
            # Expressions are re-shared, so keep what the user already used; ratings are not.
            context = context_of(model, coming if coming is not None else newest)
            top = recommender.recommend(K, exclude_used=not future, context=context)
        if context is not None:
            # The model without locals in the same context: what a device with no data is shown there.
            global_top = np.argsort(-cold_start_scores(model, context, correction), kind="stable")[:K]
        history = np.asarray(newest[name], np.int64)
        nxt = np.zeros(0, np.int64) if coming is None else np.asarray(coming[name], np.int64)
        devices.append(
            {
                "index": device.index,
                "history": history,
                "future": nxt,
                "tops": {"personalized": top.items, "global": global_top, "most_shared": most_shared},
            }
        )
        if len(examples) < show and device.num_examples >= 5:
            examples.append(
                {
                    "device": device.index,
                    "examples": device.num_examples,
                    "recent": history[:5].tolist(),
                    "next": nxt.tolist(),
                    "personalized": top.items.tolist(),
                    "local_params": top.local_params,  # "bagged" with the task's serving_resamples
                    "global": global_top.tolist(),
                }
            )
    truth = workload.truth
    probabilities: np.ndarray | None = None
    if truth is not None and devices:
        probabilities = np.stack([truth.probabilities(d["index"]) for d in devices])
    found: dict[str, np.ndarray] = {}
    bayes: BayesCeiling | None = None
    if truth is not None and probabilities is not None and ceilings:
        # A device with an empty store is not scored; it gets the prior's top-10 here all the same.
        if len(devices) <= MAX_DEVICES:
            bayes = bayes_ceiling(truth.data, [d["history"] for d in devices])
        found = ceiling_tops(
            [d["history"] for d in devices],
            probabilities,
            truth.item_topics,
            [training_shares(workload, i) for i in training],
            bayes=None if bayes is None else bayes.tops,
        )
    elif devices and ceilings:
        found = table_ceiling_tops(
            [d["history"] for d in devices],
            [training_shares(workload, i) for i in training],
            model.manifest.catalog_size,
            item_groups,
        )
    for row, d in enumerate(devices):
        d["tops"].update({method: tops[row] for method, tops in found.items()})
    scored = [
        ScoredDevice(
            d["index"],
            len(d["history"]),
            d["future"],
            None if probabilities is None else probabilities[row],
            d["tops"],
        )
        for row, d in enumerate(devices)
        if len(d["history"])
    ]
    if not scored or (probabilities is None and not any(len(d.future) for d in scored)):
        return None, examples
    return HitRates(evaluate(scored), scored, model_label(model.manifest, task), bayes), examples


def model_label(manifest: Manifest, task: TaskConfig) -> str:
    """What ran: FedRecon reconstructs locals each task, FURL keeps them; without locals it is a
    federated model whose top-10 is the same for every device's history but its context."""
    if not manifest.local_params:
        return "model (no locals)"
    return "FURL" if task.local_state is LocalState.KEEP else "FedRecon"


def training_shares(workload: Workload, device: int) -> np.ndarray:
    """A training device's shared catalog rows (positive labels), oldest first."""
    manifest = workload.manifest
    examples = workload.devices[device].examples
    name, label = manifest.task.catalog_feature, manifest.label_features[0].name
    assert name is not None
    return np.asarray(examples[name][examples[label] > 0], np.int64)


async def seen_device_examples(
    fleet: Fleet, population: str, status: dict[str, Any], show: int
) -> tuple[None, list[dict[str, Any]]]:
    """A stateful population's devices serve from the locals they kept: a few trained devices'
    top-10 next to the global one (no hit rates: no device's future was kept aside)."""
    seen = [d for d in fleet.devices if d.role == "training" and d.trained and d.num_examples >= 5]
    if not seen:
        return None, []
    client = seen[0].client
    model_dir = await client.population_model(population, status["artifact_sha256"], fleet.cache_dir)
    blob = await client.global_params_at(population, int(status["current_version"]))
    task = await client.task_config(population)

    def serve() -> list[dict[str, Any]]:
        model = TFLiteModel(model_dir)
        params = decode_params(blob, model.manifest.global_params, "global parameters")
        global_top = popularity_top(model, params)
        examples = []
        for device in seen[:show]:
            with ExampleStore(device.store_path) as store:
                kept = LocalStateStore(store, population)
                version = str(status["current_version"])
                recommender = Recommender(model, store, params, task, global_version=version, kept=kept)
                top = recommender.recommend(K, context=context_of(model, store.examples()))
                examples.append(
                    {
                        "device": device.index,
                        "examples": device.num_examples,
                        "recent": store.examples()[catalog(model)][:5].tolist(),
                        "next": [],
                        "personalized": top.items.tolist(),
                        "local_params": top.local_params,
                        "global": global_top.tolist(),
                    }
                )
        return examples

    return None, await asyncio.to_thread(serve)


def top_k_table(example: dict[str, Any], label: Callable[[int], str]) -> Table:
    """A device's personalized top-k next to the global one, catalog rows named by `label`."""
    recent = ", ".join(label(i) for i in example["recent"][:3])
    table = Table(
        title=f"device {example['device']} ({example['examples']} examples; recently: {recent})",
        title_justify="left",
    )
    table.add_column("#", justify="right")
    local_params = example.get("local_params", "reconstructed")
    table.add_column(f"personalized top-10 (on the device; {local_params} locals)")
    table.add_column("global top-10")
    nxt = set(example["next"])
    for rank, (mine, every) in enumerate(zip(example["personalized"], example["global"], strict=False), 1):
        table.add_row(
            str(rank),
            label(mine) + (" [green](shared next)[/]" if mine in nxt else ""),
            label(every) + (" [green](shared next)[/]" if every in nxt else ""),
        )
    return table
