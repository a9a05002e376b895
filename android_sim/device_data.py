"""What each simulated device holds: MovieLens users or synthetic expression sharers, as events.

A data source becomes a `FleetData`: one `DeviceData` per device (its events, oldest first)
plus what the model needs to know about the catalog. Held-out devices keep their newest
events aside (`future`): what the user shares next, to score recommendations against.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from android_sim.expressions import SyntheticConfig, SyntheticExpressions, generate_expressions
from android_sim.movielens import load_ratings, load_titles
from device_runtime.example_store import Event
from model_export.config import ITEM, LABEL, Feedback


@dataclass(frozen=True)
class DeviceData:
    item_ids: np.ndarray  # int64, oldest first
    labels: np.ndarray  # float32: a rating, or 1.0 for a share
    timestamps: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.item_ids)

    def events(self) -> list[Event]:
        return [
            Event({ITEM: int(i), LABEL: float(label)}, float(t))
            for i, label, t in zip(self.item_ids, self.labels, self.timestamps, strict=True)
        ]

    def split_future(self, count: int) -> tuple[DeviceData, np.ndarray]:
        """(the device's past, the items of its newest `count` events); at least one event stays."""
        keep = max(1, len(self) - count)
        past = DeviceData(self.item_ids[:keep], self.labels[:keep], self.timestamps[:keep])
        return past, self.item_ids[keep:]


@dataclass(frozen=True)
class ShareTruth:
    """What only the synthetic generator knows: each device's true next-share probabilities (its
    shares are independent draws from them), and each expression's topic (catalog metadata)."""

    data: SyntheticExpressions

    @property
    def item_topics(self) -> np.ndarray:
        return self.data.item_topics

    def probabilities(self, device: int) -> np.ndarray:
        return self.data.share_probabilities(self.data.users[device])


@dataclass(frozen=True)
class FleetData:
    source: str
    feedback: Feedback
    num_items: int
    item_labels: list[str]  # for printing recommendations
    devices: list[DeviceData]
    label_mean: float  # initial global mean for explicit ratings
    truth: ShareTruth | None = None  # synthetic data: the generator's ground truth
    # Public catalog metadata: each item's group (the expressions' topics), or () for none.
    item_groups: tuple[int, ...] = ()

    @property
    def num_events(self) -> int:
        return sum(len(d) for d in self.devices)


def expression_fleet(config: SyntheticConfig) -> FleetData:
    data = generate_expressions(config)
    devices = [DeviceData(u.item_ids, np.ones(len(u), np.float32), u.timestamps) for u in data.users]
    return FleetData(
        source=f"synthetic expressions ({config.num_expressions} expressions, {config.num_users} users)",
        feedback=Feedback.IMPLICIT,
        num_items=config.num_expressions,
        item_labels=[data.catalog.label(i) for i in range(len(data.catalog))],
        devices=devices,
        label_mean=1.0,
        truth=ShareTruth(data),
        item_groups=tuple(int(t) for t in data.item_topics),
    )


def movielens_fleet(path: Path, max_devices: int | None = None) -> FleetData:
    """Each MovieLens user is a device with its ratings (explicit feedback)."""
    ratings = load_ratings(path)
    devices = []
    for rows in ratings.by_user()[:max_devices]:
        rows = rows[np.argsort(ratings.timestamp[rows], kind="stable")]
        devices.append(DeviceData(ratings.item[rows], ratings.rating[rows], ratings.timestamp[rows]))
    return FleetData(
        source=f"MovieLens {path.name} ({len(ratings.rating):,} ratings, {ratings.num_users} users)",
        feedback=Feedback.EXPLICIT,
        num_items=ratings.num_items,
        item_labels=load_titles(path, ratings),
        devices=devices,
        label_mean=float(ratings.rating.mean()),
    )
