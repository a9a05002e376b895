"""`python -m benchmarks.sticker_gap` on a small sticker table: per history size, and with each
held-out user's locals reconstructed on shares of their true taste."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from android_sim.__main__ import build_parser
from android_sim.simulation.command import main as simulate_main
from android_sim.stickers import StickerConfig, draw_shares, generate_with_tastes, write
from benchmarks.sticker_gap import main


def test_true_taste_draws_follow_the_users_favourite_pack() -> None:
    config = StickerConfig(users=200)
    catalog, shares, tastes = generate_with_tastes(config)
    everyone = np.bincount(catalog.pack[shares.sticker], minlength=config.packs) / len(shares.sticker)
    for user in range(5):
        drawn = draw_shares(catalog, config, tastes[user], 400, np.random.default_rng(user))
        mine = np.bincount(catalog.pack[drawn["sticker"]], minlength=config.packs) / 400
        favourite = tastes[user].favourite
        assert mine[favourite] > 1.5 * everyone[favourite], (user, mine, everyone)
    assert drawn["previous"][0] == config.no_previous
    assert np.array_equal(drawn["previous"][1:], drawn["sticker"][:-1])


def test_the_gap_table_has_every_method_and_the_true_taste_rows(
    sticker_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    write(StickerConfig(users=120, held_out=20), data)
    args = build_parser().parse_args(
        [
            "simulate",
            "--model-dir",
            str(sticker_model),
            "--examples",
            str(data / "shares.csv"),
            "--held-out",
            str(data / "held_out.txt"),
            "--rounds",
            "3",
            "--workers",
            "1",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    simulate_main(args, Console(file=(tmp_path / "log.txt").open("w")))

    code = main(
        [
            "--run",
            str(tmp_path / "run"),
            "--data",
            str(data),
            "--model-dir",
            str(sticker_model),
            "--draws",
            "50",
        ]
    )

    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert lines[0].startswith("| hit rate@10, % | all | 1 (")
    names = [line.split(" | ")[0].lstrip("| ") for line in lines[2:]]
    assert names[:3] == ["personalized", "global", "most_shared"] and "group_rule" in names
    assert names[-2:] == [
        "FedRecon, locals on 50 shares of the true taste",
        "FedRecon, locals on 50 shares of the true taste, more steps",
    ]
