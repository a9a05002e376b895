"""The generated sticker table: seeded, its tastes stronger in group chats and at night, a spread
of history sizes, `previous` the sticker shared just before, and one clear line for bad sizes."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from android_sim.stickers import StickerConfig, generate, main, write


def favourite_share(config: StickerConfig) -> dict[str, float]:
    """How often a share is of its user's most shared pack, by context."""
    catalog, shares = generate(config)
    packs = catalog.pack[shares.sticker]
    top = np.zeros(config.users, np.int64)
    for user in range(config.users):
        top[user] = np.bincount(packs[shares.device == user], minlength=config.packs).argmax()
    hit = packs == top[shares.device]
    night = (shares.hour >= 21) | (shares.hour < 2)
    group = shares.chat_type == 1
    return {
        "direct, day": float(hit[~night & ~group].mean()),
        "group, day": float(hit[~night & group].mean()),
        "direct, night": float(hit[night & ~group].mean()),
    }


def test_tastes_are_stronger_in_group_chats_and_at_night() -> None:
    found = favourite_share(StickerConfig(users=300, seed=3))
    assert found["group, day"] > found["direct, day"] + 0.05
    assert found["direct, night"] > found["direct, day"] + 0.05


def test_history_sizes_spread_and_previous_is_the_share_before() -> None:
    config = StickerConfig(users=300)
    _, shares = generate(config)
    sizes = np.bincount(shares.device, minlength=config.users)
    assert sizes.min() >= 1 and sizes.max() <= config.max_shares
    assert (sizes <= 4).mean() > 0.03 and (sizes >= 50).mean() > 0.05  # a handful and hundreds
    for user in (0, 1, 2):
        mine = np.flatnonzero(shares.device == user)
        assert np.all(np.diff(shares.timestamp[mine]) >= 0)
        assert shares.previous[mine[0]] == config.no_previous
        assert np.array_equal(shares.previous[mine[1:]], shares.sticker[mine[:-1]])


def test_files_are_seeded_and_name_the_held_out_users(tmp_path: Path) -> None:
    config = StickerConfig(users=40, held_out=8)
    write(config, tmp_path / "a")
    write(config, tmp_path / "b")
    assert (tmp_path / "a" / "shares.csv").read_bytes() == (tmp_path / "b" / "shares.csv").read_bytes()
    held = (tmp_path / "a" / "held_out.txt").read_text().split()
    assert held == [f"user-{u:04d}" for u in range(32, 40)]
    with (tmp_path / "a" / "catalog.csv").open() as f:
        packs = [int(row["pack"]) for row in csv.DictReader(f)]
    assert len(packs) == config.stickers and set(packs) == set(range(config.packs))


def test_bad_sizes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path), "--users", "10", "--held-out", "10"]) == 2
    err = capsys.readouterr().err
    assert err == "error: held_out must be in [0, users), got 10 of 10 users\n"
