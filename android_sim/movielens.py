"""MovieLens ratings as per-user devices: 100K (`u.data`) and 1M (`ratings.dat`, optionally gzipped)."""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from android_sim.datasets import missing_hint


class DataFormatError(ValueError):
    """A ratings file that is missing or in no format this reader knows."""


@dataclass(frozen=True)
class Ratings:
    """All ratings, with ids remapped to dense 0-based indices."""

    user: np.ndarray  # int64, dense user index
    item: np.ndarray  # int64, dense item index
    rating: np.ndarray  # float32
    timestamp: np.ndarray  # int64, unix seconds
    item_raw_ids: np.ndarray  # dense item index -> id in the file
    user_raw_ids: np.ndarray

    @property
    def num_users(self) -> int:
        return len(self.user_raw_ids)

    @property
    def num_items(self) -> int:
        return len(self.item_raw_ids)

    def by_user(self) -> list[np.ndarray]:
        """Row indices of each user's ratings, in file order."""
        order = np.argsort(self.user, kind="stable")
        bounds = np.searchsorted(self.user[order], np.arange(self.num_users + 1))
        return [order[bounds[u] : bounds[u + 1]] for u in range(self.num_users)]


def require_file(path: Path) -> None:
    """Refuse a ratings file that is not there, saying how to fetch it if it is a data set's."""
    if not path.is_file():
        raise DataFormatError(f"ratings file not found: {path}{missing_hint(path)}")


def _read_text(path: Path) -> str:
    require_file(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return raw.decode("latin-1")


def load_ratings(path: Path) -> Ratings:
    """Read `u.data` (tab-separated) or `ratings.dat` (`::`-separated); the format is sniffed."""
    path = Path(path)
    text = _read_text(path)
    first = text.split("\n", 1)[0]
    if "::" in first:
        sep = "::"
    elif "\t" in first:
        sep = "\t"
    else:
        raise DataFormatError(
            f"{path}: unknown ratings format; expected MovieLens 100K u.data "
            "(user<TAB>item<TAB>rating<TAB>time) or 1M ratings.dat (user::item::rating::time), "
            f"first line is {first[:60]!r}"
        )
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split(sep)
        if len(parts) != 4:
            raise DataFormatError(f"{path}:{n}: expected 4 fields separated by {sep!r}, got {len(parts)}")
        try:
            rows.append((int(parts[0]), int(parts[1]), float(parts[2]), int(parts[3])))
        except ValueError:
            raise DataFormatError(
                f"{path}:{n}: fields must be user, item, rating, timestamp numbers: {line!r}"
            ) from None
    if not rows:
        raise DataFormatError(f"{path}: no ratings")
    data = np.asarray(rows, dtype=np.float64)
    user_raw, user = np.unique(data[:, 0].astype(np.int64), return_inverse=True)
    item_raw, item = np.unique(data[:, 1].astype(np.int64), return_inverse=True)
    return Ratings(
        user=user.astype(np.int64),
        item=item.astype(np.int64),
        rating=data[:, 2].astype(np.float32),
        timestamp=data[:, 3].astype(np.int64),
        item_raw_ids=item_raw,
        user_raw_ids=user_raw,
    )


def load_titles(ratings_path: Path, ratings: Ratings) -> list[str]:
    """Movie titles by dense item index from `u.item` or `movies.dat` beside the ratings, if present."""
    folder = Path(ratings_path).parent
    titles: dict[int, str] = {}
    for name, sep in (("u.item", "|"), ("movies.dat", "::")):
        path = folder / name
        if path.is_file():
            for line in path.read_bytes().decode("latin-1").splitlines():
                parts = line.split(sep)
                if len(parts) >= 2 and parts[0].isdigit():
                    titles[int(parts[0])] = parts[1]
            break
    return [titles.get(int(raw), f"item {int(raw)}") for raw in ratings.item_raw_ids]
