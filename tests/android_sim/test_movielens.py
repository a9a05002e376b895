"""MovieLens readers: 100K and 1M formats, gzip, and clear errors for anything else."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from android_sim.datasets import ENV_DATA_DIR
from android_sim.movielens import DataFormatError, load_ratings
from tests.conftest import ROOT


def test_movielens_100k(movielens_100k: Path) -> None:
    ratings = load_ratings(movielens_100k)

    assert len(ratings.rating) == 100_000
    assert (ratings.num_users, ratings.num_items) == (943, 1682)
    assert set(np.unique(ratings.rating)) == {1.0, 2.0, 3.0, 4.0, 5.0}
    assert sum(len(rows) for rows in ratings.by_user()) == 100_000
    assert min(len(rows) for rows in ratings.by_user()) == 20


def test_movielens_1m_format_gzipped(tmp_path: Path) -> None:
    path = tmp_path / "ratings.dat.gz"
    path.write_bytes(gzip.compress(b"1::1193::5::978300760\n1::661::3::978302109\n2::1193::4::978298413\n"))

    ratings = load_ratings(path)

    assert (ratings.num_users, ratings.num_items) == (2, 2)
    assert list(ratings.item_raw_ids) == [661, 1193]
    assert list(ratings.item) == [1, 0, 1]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"userId,movieId,rating\n1,2,3\n", "unknown ratings format"),
        (b"1\t2\t3\n", "expected 4 fields"),
        (b"1\tx\t3\t4\n", "must be user, item, rating, timestamp numbers"),
    ],
)
def test_bad_files_are_refused_with_the_reason(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "ratings.txt"
    path.write_bytes(content)

    with pytest.raises(DataFormatError, match=message):
        load_ratings(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match="not found"):
        load_ratings(tmp_path / "nope.dat")


def test_demo_command_reports_a_user_error_without_a_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "android_sim", "demo", "--ratings", str(tmp_path / "missing.dat")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )

    assert result.returncode == 2
    assert "error: ratings file not found" in result.stderr
    assert "Traceback" not in result.stderr


def test_demo_runs_a_client_task_and_recommends(tmp_path: Path, movielens_100k: Path) -> None:
    # No --ratings: the demo reads MovieLens 100K from the data-set cache the variable names.
    result = subprocess.run(
        [sys.executable, "-m", "android_sim", "demo", "--work-dir", str(tmp_path), "--user", "5"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, ENV_DATA_DIR: str(movielens_100k.parent.parent)},
    )

    assert result.returncode == 0, result.stderr
    assert "client task: completed" in result.stdout
    assert "top-10 for device 5 (personalized" in result.stdout
    ranked = [line for line in result.stdout.splitlines() if re.match(r"^\s+\d+\. ", line)]
    assert len(ranked) == 10
