"""What a fleet run or a simulation trains, whatever the data: an exported model and each device's examples.

The run takes nothing else from the data: the population's task config is the model's training
defaults with the data's defaults (`task`) and the run's options over them; the server optimizer
is the data's default with the run's options over it. A built-in data set adds what only it
knows: the catalog's names for top-k tables, and the centralized dataset mixing draws from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from contracts.features import Examples
from contracts.manifest import Manifest
from device_runtime.examples_table import DeviceExamples

if TYPE_CHECKING:
    from rich.console import Console

    from android_sim.device_data import ShareTruth
    from android_sim.fleet import Fleet

# The training devices' indices -> (centralized examples, their public accounts, items no
# training device holds): the public data mixing draws from (`android_sim.central_data`).
CentralSource = Callable[[Sequence[int]], tuple[Examples, np.ndarray, np.ndarray]]


class DataReport(Protocol):
    """What a data set adds to a run's report beyond the model's metrics (e.g. next-word accuracy
    with and without OOV, which are ratios of the evaluation's sums)."""

    async def serve(self, fleet: Fleet, population: str, status: dict[str, Any], show: int) -> Any:
        """After training, while the devices can reach the server (e.g. held-out devices' predictions)."""
        ...

    def section(
        self, served: Any, fleet: Fleet, rounds: list[dict[str, Any]], final: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The report's entries of this data (merged into the report; a "data" entry into its "data")."""
        ...

    def plot(self, path: Path, rounds: list[dict[str, Any]]) -> None:
        """The metrics plot of this data's rounds."""
        ...

    def print(self, body: dict[str, Any], console: Console) -> None:
        """The summary lines of this data, from the report."""
        ...


@dataclass(frozen=True)
class Workload:
    source: str  # what the data is, said in the console and the report
    name: str  # the population's name before the model's hash (e.g. "expressions")
    model_dir: Path
    manifest: Manifest
    devices: list[DeviceExamples]  # each one's examples oldest first (`oldest_first`)
    task: dict[str, Any] = field(default_factory=dict)  # task config fields over the model's defaults
    server_optimizer: dict[str, Any] = field(default_factory=lambda: {"name": "sgd", "learning_rate": 1.0})
    item_labels: Sequence[str] | None = None  # a ranking model's catalog rows by name, for top-k tables
    central: CentralSource | None = None  # the data's public examples, for mixing
    held_out: frozenset[int] | None = None  # the data's own held-out devices (else drawn at random)
    report: DataReport | None = None  # the data's own report section
    # Synthetic data: the generator's ground truth, to score held-out top-10s by their expected hit rate.
    truth: ShareTruth | None = None

    @property
    def num_examples(self) -> int:
        return sum(d.examples.num_examples for d in self.devices)

    @property
    def ranks_shares(self) -> bool:
        """A ranking model on implicit feedback: held-out devices keep their newest share aside
        to score the top-k against."""
        return self.manifest.task.kind == "ranking" and self.manifest.task.negative_sampling

    def label(self, item: int) -> str:
        return self.item_labels[item] if self.item_labels is not None else str(item)


def oldest_first(device: DeviceExamples) -> DeviceExamples:
    """The device's examples in time order (ties in table order), as its store holds them."""
    order = np.argsort(device.timestamps, kind="stable")
    if np.array_equal(order, np.arange(len(order))):
        return device
    return DeviceExamples(device.device_id, device.examples.select(order), device.timestamps[order])


def newest_first(device: DeviceExamples) -> Examples:
    """A device's examples (oldest first) in the order its store hands them out."""
    return device.examples.select(slice(None, None, -1))


def split_newest(device: DeviceExamples, count: int) -> tuple[DeviceExamples, Examples]:
    """(the device's past, its newest `count` examples); at least one example stays."""
    keep = max(1, device.examples.num_examples - count)
    past = DeviceExamples(device.device_id, device.examples.select(slice(0, keep)), device.timestamps[:keep])
    return past, device.examples.select(slice(keep, None))
