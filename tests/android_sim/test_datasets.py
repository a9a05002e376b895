"""The data-set fetcher against a real HTTP server on loopback: a good download, a truncated one,
one with the wrong checksum, an error status, no server; archives unpacked and their files
checked; a copy already in place accepted when it matches and refused when it does not; and a
missing data set is one line that says how to get it."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from android_sim.datasets import (
    CHECKSUM_FILE,
    DATASETS,
    ENV_DATA_DIR,
    DatasetError,
    data_dir,
    fetch,
    verify,
)
from android_sim.shakespeare import read_roles
from tests.conftest import ROOT


class Files:
    """What the loopback server answers: path -> body (404 for anything else)."""

    def __init__(self) -> None:
        self.bodies: dict[str, bytes] = {}
        self.requests: list[str] = []


@pytest.fixture
def server() -> Iterator[tuple[str, Files]]:
    files = Files()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            files.requests.append(self.path)
            body = files.bodies.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", files
    httpd.shutdown()
    httpd.server_close()


def test_a_good_download_is_checked_unpacked_and_readable(
    server: tuple[str, Files], tiny_shakespeare: Path, tmp_path: Path
) -> None:
    url, files = server
    files.bodies["/input.txt"] = (tiny_shakespeare / "input.txt").read_bytes()

    folder = fetch("tinyshakespeare", tmp_path, url=f"{url}/input.txt")

    assert folder == tmp_path / "tinyshakespeare"
    assert (folder / CHECKSUM_FILE).read_text().split() == [DATASETS["tinyshakespeare"].sha256, "input.txt"]
    assert len(read_roles(folder)) > 300  # the reader's own checksum check passes too
    assert fetch("tinyshakespeare", tmp_path, url=f"{url}/input.txt") == folder
    assert files.requests == ["/input.txt"]  # present and verified: not downloaded again


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda body: body[: len(body) // 2], "truncated"),
        (lambda body: body[:-1] + b"?", "sha256"),
        (lambda body: body + b"more", "more than the expected"),
    ],
    ids=["truncated", "wrong-checksum", "too-long"],
)
def test_a_bad_download_is_one_line_that_says_what_to_fetch_by_hand_and_leaves_nothing(
    server: tuple[str, Files], tiny_shakespeare: Path, tmp_path: Path, damage: object, said: str
) -> None:
    url, files = server
    files.bodies["/input.txt"] = damage((tiny_shakespeare / "input.txt").read_bytes())  # type: ignore[operator]

    with pytest.raises(DatasetError) as caught:
        fetch("tinyshakespeare", tmp_path, url=f"{url}/input.txt")

    message = str(caught.value)
    assert "\n" not in message and said in message
    assert DATASETS["tinyshakespeare"].url in message
    assert f"save it as {tmp_path / 'tinyshakespeare.txt'}" in message
    assert list(tmp_path.iterdir()) == []  # no partial download, no half-filled folder


def test_an_error_status_or_no_server_is_one_line(server: tuple[str, Files], tmp_path: Path) -> None:
    url, _ = server
    with pytest.raises(DatasetError, match=r"HTTP 404.*by hand"):
        fetch("movielens-1m", tmp_path, url=f"{url}/ml-1m.zip")
    with pytest.raises(DatasetError, match=r"could not fetch MovieLens 100K from http://127\.0\.0\.1:9/"):
        fetch("movielens-100k", tmp_path, url="http://127.0.0.1:9/ml-100k.zip", timeout=5.0)
    assert list(tmp_path.iterdir()) == []


def _zipped(folder: Path, top: str, names: list[str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            archive.write(folder / name, f"{top}/{name}")
        archive.writestr(f"{top}/allbut.pl", "# not needed\n")
    return buffer.getvalue()


def test_an_archive_is_unpacked_and_every_file_checked_against_its_pin(
    server: tuple[str, Files], movielens_100k: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real MovieLens 100K files in an archive of our own making (the real archive's pinned
    # checksum is the only thing this replaces): unpacking and the per-file pins are real.
    url, files = server
    spec = DATASETS["movielens-100k"]
    archive = _zipped(movielens_100k.parent, "ml-100k", list(spec.files))
    monkeypatch.setitem(
        DATASETS,
        spec.name,
        replace(spec, sha256=hashlib.sha256(archive).hexdigest(), size=len(archive)),
    )
    files.bodies["/ml-100k.zip"] = archive

    folder = fetch("movielens-100k", tmp_path, url=f"{url}/ml-100k.zip")

    assert sorted(p.name for p in folder.iterdir()) == sorted([*spec.files, CHECKSUM_FILE])
    assert (folder / "u.data").read_bytes() == movielens_100k.read_bytes()

    # An archive whose files are not the pinned ones is refused although its own checksum matches.
    (tmp_path / "edited").mkdir()
    for name in spec.files:
        shutil.copy(movielens_100k.parent / name, tmp_path / "edited" / name)
    with (tmp_path / "edited" / "u.data").open("ab") as extra:
        extra.write(b"1\t1\t5\t0\n")
    bad = _zipped(tmp_path / "edited", "ml-100k", list(spec.files))
    monkeypatch.setitem(
        DATASETS, spec.name, replace(spec, sha256=hashlib.sha256(bad).hexdigest(), size=len(bad))
    )
    files.bodies["/bad.zip"] = bad
    with pytest.raises(DatasetError, match=r"unpacked u\.data has sha256"):
        fetch("movielens-100k", tmp_path / "other", url=f"{url}/bad.zip")


def test_a_download_saved_by_hand_is_checked_and_unpacked_without_the_network(
    tiny_shakespeare: Path, tmp_path: Path
) -> None:
    saved = tmp_path / "tinyshakespeare.txt"
    saved.write_bytes((tiny_shakespeare / "input.txt").read_bytes()[:-1])
    with pytest.raises(DatasetError, match=r"tinyshakespeare\.txt is not the expected download"):
        fetch("tinyshakespeare", tmp_path, url="http://127.0.0.1:9/unused")
    assert not (tmp_path / "tinyshakespeare").exists()

    shutil.copy(tiny_shakespeare / "input.txt", saved)
    folder = fetch("tinyshakespeare", tmp_path, url="http://127.0.0.1:9/unused")
    assert (folder / "input.txt").read_bytes() == saved.read_bytes()


def test_a_copy_in_place_is_used_when_it_matches_and_refused_when_altered(
    movielens_100k: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "movielens-100k"
    shutil.copytree(movielens_100k.parent, folder)
    assert verify("movielens-100k", tmp_path) == folder
    assert fetch("movielens-100k", tmp_path, url="http://127.0.0.1:9/unused") == folder

    (folder / "u.item").write_bytes((folder / "u.item").read_bytes()[:-10])
    with pytest.raises(DatasetError, match=r"u\.item has sha256 .*altered or truncated"):
        fetch("movielens-100k", tmp_path, url="http://127.0.0.1:9/unused")
    assert (folder / "u.data").exists()  # someone's copy is never overwritten or removed


def test_the_cache_folder_follows_the_option_then_the_variable_then_the_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_DATA_DIR, str(tmp_path / "env"))
    assert data_dir(tmp_path / "option") == tmp_path / "option"
    assert data_dir() == tmp_path / "env"
    monkeypatch.delenv(ENV_DATA_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert data_dir() == tmp_path / "cache" / "fedrecon" / "data"


def _python(*args: str, data: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, ENV_DATA_DIR: str(data), "TF_CPP_MIN_LOG_LEVEL": "2"},
    )


def test_the_fetch_command(server: tuple[str, Files], tiny_shakespeare: Path, tmp_path: Path) -> None:
    url, files = server
    files.bodies["/input.txt"] = (tiny_shakespeare / "input.txt").read_bytes()
    data = tmp_path / "data"

    good = _python("android_sim.datasets", "fetch", "tinyshakespeare", "--url", f"{url}/input.txt", data=data)
    assert good.returncode == 0, good.stderr
    assert good.stdout.strip() == f"tinyshakespeare: {data / 'tinyshakespeare'}"

    listed = _python("android_sim.datasets", "list", data=data)
    assert f"ok  {data / 'tinyshakespeare'}" in listed.stdout
    assert "python -m android_sim.datasets fetch movielens-1m" in listed.stdout
    # An altered folder is not a missing one: the list says which file and what to do.
    with (data / "tinyshakespeare" / "input.txt").open("a") as text:
        text.write("an edit\n")
    altered = _python("android_sim.datasets", "list", data=data)
    (line,) = [line for line in altered.stdout.splitlines() if line.startswith("tinyshakespeare")]
    assert "!!  altered: " in line and "input.txt has sha256" in line and "remove the folder" in line

    failed = _python("android_sim.datasets", "fetch", "movielens-1m", "--url", f"{url}/nope.zip", data=data)
    assert failed.returncode == 1
    assert failed.stderr.count("\n") == 1 and failed.stderr.startswith("error: could not fetch MovieLens 1M")
    assert "Traceback" not in failed.stderr

    unknown = _python("android_sim.datasets", "fetch", "movielens-10m", data=data)
    assert unknown.returncode == 2 and "invalid choice" in unknown.stderr


@pytest.mark.parametrize(
    ("command", "name"),
    [
        (("android_sim", "demo"), "movielens-100k"),
        (("android_sim", "run", "--data", "movielens", "--rounds", "1"), "movielens-100k"),
        (("android_sim.shakespeare",), "tinyshakespeare"),
    ],
    ids=["demo", "run-movielens", "shakespeare"],
)
def test_a_command_without_its_data_set_says_in_one_line_how_to_fetch_it(
    command: tuple[str, ...], name: str, tmp_path: Path
) -> None:
    result = _python(*command, data=tmp_path / "empty")

    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:")
    assert f"python -m android_sim.datasets fetch {name}" in lines[0]
    assert DATASETS[name].url in lines[0]


@pytest.mark.parametrize("module", ["benchmarks.scale", "benchmarks.speed_baseline"])
def test_a_benchmark_without_movielens_says_in_one_line_how_to_fetch_it(module: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", module, "--rounds", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        # Run elsewhere than the checkout (its files stay clean): the path finds `benchmarks`.
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            ENV_DATA_DIR: str(tmp_path / "empty"),
            "TF_CPP_MIN_LOG_LEVEL": "2",
        },
    )

    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: MovieLens 100K not found")
    assert "python -m android_sim.datasets fetch movielens-100k" in lines[0]
