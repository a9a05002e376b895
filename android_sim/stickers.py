"""A generated sticker-sharing table shaped like a user's own: packs, tastes, context, history sizes.

`python -m android_sim.stickers OUT_DIR` writes what a user brings to `simulate` and `run`:
`shares.csv` (device_id, timestamp, sticker, hour, chat_type, previous), `catalog.csv` (each
sticker's pack: the catalog's grouping feature) and `held_out.txt` (the devices to hold out).

How a share is drawn, and why (not the main job's generator, `android_sim.expressions`, which
places items and users in a latent space):
- **Packs** (the grouping): each sticker belongs to one pack; packs differ in popularity and a
  pack's stickers follow a Zipf law inside it, so most-shared is a real baseline.
- **Tastes**: each user has a favourite pack and a second one; the share's pack is drawn from
  the packs' popularity tilted towards them.
- **Context**: the tilt is stronger in group chats and at night (21h-2h), and some packs are
  night packs; the hour and the chat type are the model's context features.
- **Sessions**: the next share stays in the previous sticker's pack with some probability, and
  users re-share a few favourite stickers (`previous` is the sticker shared before, or
  `NO_PREVIOUS` for a user's first share).
- **History sizes**: shares per user are log-normal (many users with a handful, a few with
  hundreds), over a window of days with a daily rhythm.
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

START = 1_763_600_000  # 2025-11-20, a fixed start: the table is the same on every machine


@dataclass(frozen=True)
class StickerConfig:
    users: int = 800
    stickers: int = 240
    packs: int = 12
    held_out: int = 160  # the last users by id, written to held_out.txt
    mean_log_shares: float = 2.9  # log-normal shares per user: median e^2.9 = 18
    sd_log_shares: float = 1.0
    max_shares: int = 300
    favourite_tilt: float = 1.6  # log-odds added to the favourite pack (half to the second one)
    group_tilt: float = 1.0  # added to the tilt in a group chat
    night_tilt: float = 1.0  # added to the tilt at night
    stay_in_pack: float = 0.3  # a share stays in the previous sticker's pack
    reshare: float = 0.2  # a share is one of the user's three favourite stickers
    days: int = 60
    seed: int = 0

    @property
    def no_previous(self) -> int:
        """The `previous` value of a user's first share: one past the last sticker."""
        return self.stickers


@dataclass(frozen=True)
class Catalog:
    pack: np.ndarray  # (stickers,) each sticker's pack
    within: np.ndarray  # (stickers,) its probability inside its pack
    pack_popularity: np.ndarray  # (packs,) log-popularity of each pack
    night_pack: np.ndarray  # (packs,) bool


@dataclass(frozen=True)
class Shares:
    device: np.ndarray  # int, one per share, each user's shares oldest first
    timestamp: np.ndarray
    sticker: np.ndarray
    hour: np.ndarray
    chat_type: np.ndarray  # 0: a direct chat, 1: a group
    previous: np.ndarray


def make_catalog(config: StickerConfig, rng: np.random.Generator) -> Catalog:
    if config.packs < 2 or config.stickers < config.packs:
        raise ValueError(
            f"need at least 2 packs and a sticker per pack, got {config.packs} packs and "
            f"{config.stickers} stickers"
        )
    pack = np.concatenate(
        [np.arange(config.packs), rng.integers(0, config.packs, config.stickers - config.packs)]
    )
    pack = np.sort(pack)
    within = np.zeros(config.stickers)
    for p in range(config.packs):
        members = np.flatnonzero(pack == p)
        weights = 1.0 / (1.0 + rng.permutation(len(members))) ** 1.1  # Zipf inside the pack
        within[members] = weights / weights.sum()
    pack_popularity = rng.normal(0.0, 0.6, config.packs)
    night_pack = rng.random(config.packs) < 0.25
    return Catalog(pack, within, pack_popularity, night_pack)


def pack_probabilities(
    catalog: Catalog, config: StickerConfig, favourite: int, second: int, hour: int, group: bool
) -> np.ndarray:
    """P(pack) of a user's share at `hour` in a group chat or not."""
    night = hour >= 21 or hour < 2
    tilt = config.favourite_tilt + config.group_tilt * group + config.night_tilt * night
    logits = catalog.pack_popularity + (0.8 if night else -0.4) * catalog.night_pack
    logits = logits.copy()
    logits[favourite] += tilt
    logits[second] += tilt / 2
    p = np.exp(logits - logits.max())
    return np.asarray(p / p.sum())


@dataclass(frozen=True)
class Taste:
    """A user's true taste, as the generator draws their shares from it."""

    favourite: int  # pack
    second: int  # pack
    favourites: np.ndarray  # the three stickers of the favourite pack they re-share
    group_share: float  # how often they share in a group chat
    night_owl: float  # how often at night


def next_sticker(
    catalog: Catalog,
    config: StickerConfig,
    taste: Taste,
    hour: int,
    group: bool,
    previous: int,
    rng: np.random.Generator,
) -> int:
    """The sticker a user of `taste` shares at `hour` (in a group chat or not) after `previous`."""
    if previous != config.no_previous and rng.random() < config.stay_in_pack:
        pack = int(catalog.pack[previous])
    else:
        probabilities = pack_probabilities(catalog, config, taste.favourite, taste.second, hour, group)
        pack = int(rng.choice(config.packs, p=probabilities))
    if pack == taste.favourite and rng.random() < config.reshare:
        return int(rng.choice(taste.favourites))
    members = np.flatnonzero(catalog.pack == pack)
    return int(rng.choice(members, p=catalog.within[members] / catalog.within[members].sum()))


def draw_shares(
    catalog: Catalog, config: StickerConfig, taste: Taste, count: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """`count` fresh shares of a user of `taste` (sticker, hour, chat_type, previous), in order:
    what their true taste gives, for measuring a model's locals against it."""
    columns: dict[str, list[int]] = {"sticker": [], "hour": [], "chat_type": [], "previous": []}
    previous = config.no_previous
    for _ in range(count):
        night = rng.random() < taste.night_owl
        hour = int(rng.choice([21, 22, 23, 0, 1])) if night else int(rng.integers(7, 21))
        group = bool(rng.random() < taste.group_share)
        sticker = next_sticker(catalog, config, taste, hour, group, previous, rng)
        for key, value in zip(columns, (sticker, hour, int(group), previous), strict=True):
            columns[key].append(value)
        previous = sticker
    return {k: np.asarray(v, np.int64) for k, v in columns.items()}


def generate(config: StickerConfig) -> tuple[Catalog, Shares]:
    catalog, shares, _ = generate_with_tastes(config)
    return catalog, shares


def generate_with_tastes(config: StickerConfig) -> tuple[Catalog, Shares, list[Taste]]:
    """The catalog, every share, and each user's taste (by user index)."""
    rng = np.random.default_rng(config.seed)
    catalog = make_catalog(config, rng)
    popular = np.exp(catalog.pack_popularity) / np.exp(catalog.pack_popularity).sum()
    columns: dict[str, list[int]] = {
        k: [] for k in ("device", "timestamp", "sticker", "hour", "chat", "prev")
    }
    tastes: list[Taste] = []
    for user in range(config.users):
        favourite = int(rng.choice(config.packs, p=popular))
        second = int(rng.choice(np.delete(np.arange(config.packs), favourite)))
        favourites = rng.choice(np.flatnonzero(catalog.pack == favourite), size=3, p=None)
        taste = Taste(favourite, second, favourites, float(rng.beta(2, 3)), float(rng.beta(2, 4)))
        tastes.append(taste)
        n = int(
            np.clip(round(rng.lognormal(config.mean_log_shares, config.sd_log_shares)), 1, config.max_shares)
        )
        night = rng.random(n) < taste.night_owl
        hours = np.where(night, rng.choice([21, 22, 23, 0, 1], n), rng.integers(7, 21, n))
        # In time order, so that `previous` is the sticker shared just before.
        times = np.sort(
            START + 86_400 * rng.integers(0, config.days, n) + 3_600 * hours + rng.integers(0, 3_600, n)
        )
        previous = config.no_previous
        for when in times.tolist():
            hour = int((when - START) // 3_600 % 24)
            group = bool(rng.random() < taste.group_share)
            sticker = next_sticker(catalog, config, taste, hour, group, previous, rng)
            for key, value in zip(columns, (user, when, sticker, hour, int(group), previous), strict=True):
                columns[key].append(value)
            previous = sticker
    a = {k: np.asarray(v, np.int64) for k, v in columns.items()}
    shares = Shares(a["device"], a["timestamp"], a["sticker"], a["hour"], a["chat"], a["prev"])
    return catalog, shares, tastes


def device_id(user: int) -> str:
    return f"user-{user:04d}"


def write(config: StickerConfig, out: Path) -> dict[str, int]:
    """shares.csv, catalog.csv and held_out.txt in `out`; returns their sizes."""
    if not 0 <= config.held_out < config.users:
        raise ValueError(f"held_out must be in [0, users), got {config.held_out} of {config.users} users")
    catalog, shares = generate(config)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "shares.csv").open("w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(["device_id", "timestamp", "sticker", "hour", "chat_type", "previous"])
        for i in range(len(shares.device)):
            rows.writerow(
                [
                    device_id(int(shares.device[i])),
                    int(shares.timestamp[i]),
                    int(shares.sticker[i]),
                    int(shares.hour[i]),
                    int(shares.chat_type[i]),
                    int(shares.previous[i]),
                ]
            )
    with (out / "catalog.csv").open("w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(["sticker", "pack"])
        rows.writerows([i, int(p)] for i, p in enumerate(catalog.pack))
    held = [device_id(u) for u in range(config.users - config.held_out, config.users)]
    (out / "held_out.txt").write_text("".join(f"{d}\n" for d in held))
    return {"users": config.users, "shares": len(shares.device), "held_out": len(held)}


def main(argv: list[str] | None = None) -> int:
    d = StickerConfig()
    parser = argparse.ArgumentParser(
        prog="python -m android_sim.stickers",
        description="Write a generated sticker-sharing table (shares.csv), its catalog's packs "
        "(catalog.csv) and the devices to hold out (held_out.txt) into OUT_DIR.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--users", type=int, default=d.users)
    parser.add_argument("--stickers", type=int, default=d.stickers)
    parser.add_argument("--packs", type=int, default=d.packs)
    parser.add_argument("--held-out", type=int, default=d.held_out, help="users held out (the last ones)")
    parser.add_argument("--seed", type=int, default=d.seed)
    args = parser.parse_args(argv)
    config = StickerConfig(
        users=args.users, stickers=args.stickers, packs=args.packs, held_out=args.held_out, seed=args.seed
    )
    try:
        sizes = write(config, args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{sizes['shares']:,} shares of {sizes['users']} users ({sizes['held_out']} held out) "
        f"over {config.stickers} stickers in {config.packs} packs: {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
