"""The public data sets the simulator and benchmarks use, fetched into a cache and verified.

`python -m android_sim.datasets fetch NAME` downloads a data set from its public address, checks
the archive's pinned sha256 and size, unpacks it and checks the unpacked files. A folder that
already holds the files is used as it is when their checksums match (a copy unpacked by hand, or
one a CI machine provides), so nothing is downloaded twice and nothing unverified is read.

Where: `--data-dir`, else `$FEDRECON_DATA_DIR`, else a per-user cache folder
(`$XDG_CACHE_HOME/fedrecon/data`, `~/.cache/fedrecon/data` without it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from contracts.command_line import CommandParser, quiet_on_closed_pipe

ENV_DATA_DIR = "FEDRECON_DATA_DIR"
CHECKSUM_FILE = "SHA256SUMS"
FETCH_COMMAND = "python -m android_sim.datasets fetch"
_CHUNK = 1 << 16


class DatasetError(RuntimeError):
    """A data set that is missing, altered, or could not be fetched; the message is one line."""


class DatasetAltered(DatasetError):
    """A data set's folder is there but a file in it is not what the fetcher unpacked."""


@dataclass(frozen=True)
class Dataset:
    """One data set: where it comes from, what its archive and files must hash to."""

    name: str
    title: str
    url: str
    sha256: str  # of the download (an archive, or the file itself)
    size: int
    main_file: str  # the file commands read
    # Unpacked files and their pinned sha256; None when no pin is published: those are recorded in
    # SHA256SUMS when the (pinned) archive is unpacked and checked against that record afterwards.
    files: Mapping[str, str | None]
    download_name: str  # a download saved by hand in the cache folder under this name is used
    zip_folder: str | None = None  # the archive's top folder; None: the download is `main_file`

    def by_hand(self, root: Path) -> str:
        """What to do without internet on this machine: one sentence."""
        return (
            f"download {self.url} by hand, save it as {root / self.download_name} and run "
            f"`{FETCH_COMMAND} {self.name}` (it checks and unpacks it)"
        )

    def hint(self, folder: Path) -> str:
        return f"fetch it with `{FETCH_COMMAND} {self.name}`, or {self.by_hand(folder.parent)}"


DATASETS: dict[str, Dataset] = {
    dataset.name: dataset
    for dataset in (
        Dataset(
            name="movielens-100k",
            title="MovieLens 100K",
            url="https://files.grouplens.org/datasets/movielens/ml-100k.zip",
            sha256="50d2a982c66986937beb9ffb3aa76efe955bf3d5c6b761f4e3a7cd717c6a3229",
            size=4_924_029,
            main_file="u.data",
            download_name="ml-100k.zip",
            files={
                "README": "4883b8cf340ed0059971b33f56ad3adc88a40792108ebca3d24aafc4c82e8b52",
                "u.data": "06416e597f82b7342361e41163890c81036900f418ad91315590814211dca490",
                "u.genre": "9757e0d3e6b298159a80dd48eaf938114690e911e39af97a76949ef1663610bb",
                "u.info": "5b0a40b2e47a729ee6203063f6dcf8790c2e63f5a18663e6ee318a72c5f3c27b",
                "u.item": "553841ebc7de3a0fd0d6b62a204ea30c1e651aacfb2814c7a6584ac52f2c5701",
                "u.occupation": "cd5fbec9afe345d993a62fc7817df1a4a9079c4feb267b3118763b8fd942137d",
                "u.user": "f120e114da2e8cf314fd28f99417c94ae9ddf1cb6db8ce0e4b5995d40e90e62c",
            },
            zip_folder="ml-100k",
        ),
        Dataset(
            name="movielens-1m",
            title="MovieLens 1M",
            url="https://files.grouplens.org/datasets/movielens/ml-1m.zip",
            sha256="a6898adb50b9ca05aa231689da44c217cb524e7ebd39d264c56e2832f2c54e20",
            size=5_917_549,
            main_file="ratings.dat",
            download_name="ml-1m.zip",
            files={"README": None, "movies.dat": None, "ratings.dat": None, "users.dat": None},
            zip_folder="ml-1m",
        ),
        Dataset(
            name="tinyshakespeare",
            title="Tiny Shakespeare",
            url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
            sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
            size=1_115_394,
            main_file="input.txt",
            download_name="tinyshakespeare.txt",
            files={"input.txt": "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"},
        ),
    )
}


def data_dir(explicit: Path | None = None) -> Path:
    """The cache folder: the argument, else $FEDRECON_DATA_DIR, else the per-user cache."""
    if explicit is not None:
        return explicit
    if os.environ.get(ENV_DATA_DIR):
        return Path(os.environ[ENV_DATA_DIR])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "fedrecon" / "data"


def dataset(name: str) -> Dataset:
    try:
        return DATASETS[name]
    except KeyError:
        raise DatasetError(f"unknown data set {name!r}; expected one of {', '.join(DATASETS)}") from None


def folder_of(name: str, root: Path | None = None) -> Path:
    """Where data set `name` lives (whether or not it is there yet)."""
    return data_dir(root) / dataset(name).name


def default_file(name: str) -> Path:
    """The file a command reads by default: the data set's main file in the cache folder."""
    ds = dataset(name)
    return folder_of(name) / ds.main_file


def cached_file(name: str, root: Path | None = None) -> Path:
    """The data set's main file in the cache; DatasetError (which file is missing, how to fetch it)
    when it is not there. For commands that read a data set only from the cache (benchmarks)."""
    ds = dataset(name)
    path = folder_of(name, root) / ds.main_file
    if not path.is_file():
        raise DatasetError(f"{ds.title} not found ({path} is missing); {ds.hint(path.parent)}")
    return path


def missing_hint(path: Path) -> str:
    """For a data file that is not there: how to get it, if it is one of the data sets' files."""
    for ds in DATASETS.values():
        if path.name == ds.main_file:
            return f"; {ds.title}: {ds.hint(path.parent)}"
    return ""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _recorded(folder: Path) -> dict[str, str]:
    sums = folder / CHECKSUM_FILE
    if not sums.is_file():
        return {}
    out = {}
    for line in sums.read_text(encoding="ascii", errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 2:
            out[parts[1].lstrip("*")] = parts[0].lower()
    return out


def verify(name: str, root: Path | None = None) -> Path:
    """The data set's folder when every file is there and matches its checksum; else DatasetError."""
    ds, folder = dataset(name), folder_of(name, root)
    recorded = _recorded(folder)
    for file, pinned in ds.files.items():
        path = folder / file
        if not path.is_file():
            raise DatasetError(f"{ds.title} not found ({path} is missing); {ds.hint(folder)}")
        expected = pinned or recorded.get(file)
        if expected is None:
            raise DatasetAltered(
                f"{ds.title} in {folder} has no checksum for {file} (not unpacked by the fetcher); "
                f"remove the folder and {ds.hint(folder)}"
            )
        actual = sha256_of(path)
        if actual != expected:
            raise DatasetAltered(
                f"{path} has sha256 {actual[:12]}..., expected {expected[:12]}... (altered or truncated); "
                f"remove the folder and {ds.hint(folder)}"
            )
    return folder


def _saved_by_hand(ds: Dataset, path: Path) -> Path:
    """A download someone saved in the cache folder, checked like one."""
    size, actual = path.stat().st_size, sha256_of(path)
    if size != ds.size or actual != ds.sha256:
        raise DatasetError(
            f"{path} is not the expected download ({size:,} bytes, sha256 {actual[:12]}...; expected "
            f"{ds.size:,} bytes, {ds.sha256[:12]}...): remove it and download {ds.url} again"
        )
    return path


def _download(ds: Dataset, url: str, into: Path, timeout: float) -> Path:
    """The download, streamed to a file in `into` with its sha256 and size checked."""
    import httpx  # only the fetch needs it

    target = into / "download"
    digest, size = hashlib.sha256(), 0
    try:
        with (
            httpx.stream("GET", url, follow_redirects=True, timeout=timeout) as response,
            target.open("wb") as out,
        ):
            if response.status_code != 200:
                raise DatasetError(f"HTTP {response.status_code}")
            for chunk in response.iter_bytes(_CHUNK):
                size += len(chunk)
                if size > ds.size:
                    raise DatasetError(f"more than the expected {ds.size:,} bytes")
                digest.update(chunk)
                out.write(chunk)
    except httpx.HTTPError as error:
        raise DatasetError(str(error) or type(error).__name__) from None
    if size != ds.size:
        raise DatasetError(f"got {size:,} bytes, expected {ds.size:,} (truncated)")
    if digest.hexdigest() != ds.sha256:
        raise DatasetError(f"sha256 {digest.hexdigest()[:12]}..., expected {ds.sha256[:12]}...")
    return target


def _unpack(ds: Dataset, download: Path, staging: Path) -> None:
    """The data set's files into `staging`, with SHA256SUMS recording each file's checksum."""
    if ds.zip_folder is None:
        shutil.copyfile(download, staging / ds.main_file)
    else:
        try:
            with zipfile.ZipFile(download) as archive:
                for file in ds.files:
                    with (
                        archive.open(f"{ds.zip_folder}/{file}") as src,
                        (staging / file).open("wb") as dst,
                    ):
                        shutil.copyfileobj(src, dst)
        except (zipfile.BadZipFile, KeyError) as error:
            raise DatasetError(f"not the expected archive ({error})") from None
    lines = []
    for file, pinned in ds.files.items():
        actual = sha256_of(staging / file)
        if pinned is not None and actual != pinned:
            raise DatasetError(f"unpacked {file} has sha256 {actual[:12]}..., expected {pinned[:12]}...")
        lines.append(f"{actual}  {file}\n")
    (staging / CHECKSUM_FILE).write_text("".join(lines), encoding="ascii")


def fetch(name: str, root: Path | None = None, *, url: str | None = None, timeout: float = 30.0) -> Path:
    """The data set's verified folder, downloaded and unpacked first if it is not there.

    A download saved by hand in the cache folder (`download_name`) is used instead of the network;
    `url` replaces the public address (a mirror). Nothing is left behind on failure: the files
    are unpacked into a staging folder beside the target and moved into place once checked."""
    ds, folder = dataset(name), folder_of(name, root)
    try:
        return verify(name, root)
    except DatasetError:
        if folder.exists() and any(folder.iterdir()):
            raise  # files that do not match: say so rather than overwrite someone's copy
    saved = folder.parent / ds.download_name
    source = str(saved) if saved.is_file() else url or ds.url
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{ds.name}-", dir=folder.parent) as work:
            staging = Path(work) / ds.name
            staging.mkdir()
            if saved.is_file():
                download = _saved_by_hand(ds, saved)
            else:
                download = _download(ds, source, Path(work), timeout)
            _unpack(ds, download, staging)
            if folder.exists():
                folder.rmdir()  # empty, checked above
            staging.rename(folder)
    except (DatasetError, OSError) as error:
        raise DatasetError(
            f"could not fetch {ds.title} from {source}: {error}; {ds.by_hand(folder.parent)}"
        ) from None
    return verify(name, root)


@quiet_on_closed_pipe
def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(
        prog="python -m android_sim.datasets",
        description="Fetch and verify the public data sets (MovieLens 100K and 1M, Tiny Shakespeare) "
        f"into a cache folder: --data-dir, else ${ENV_DATA_DIR}, else ~/.cache/fedrecon/data.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("fetch", help="download, verify and unpack data sets (skipped when present)")
    get.add_argument("names", nargs="+", choices=sorted(DATASETS), metavar="NAME", help=", ".join(DATASETS))
    get.add_argument("--url", help="download from this address instead (one data set; a mirror)")
    show = sub.add_parser("list", help="each data set, its folder and whether it is there and verified")
    for command in (get, show):
        command.add_argument("--data-dir", type=Path, help=f"the cache folder (default: ${ENV_DATA_DIR})")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, ds in DATASETS.items():
            try:
                status = f"ok  {verify(name, args.data_dir)}"
            except DatasetAltered as altered:  # there, but not as fetched: say what is wrong
                status = f"!!  altered: {altered}"
            except DatasetError:
                status = f"--  {folder_of(name, args.data_dir)} (fetch: {FETCH_COMMAND} {name})"
            print(f"{name:16} {ds.title:17} {status}")
        return 0
    if args.url and len(args.names) > 1:
        parser.error("--url is for one data set at a time")
    failed = False
    for name in args.names:
        try:
            print(f"{name}: {fetch(name, args.data_dir, url=args.url)}")
        except DatasetError as error:
            print(f"error: {error}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
