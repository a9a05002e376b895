"""Every install line in the docs installs what the commands of its page import.

Each line is resolved for real: pip, run for a fresh virtual environment (`pip --python`), resolves
the line's arguments as written with `install --dry-run --report` against the registry (and the
line's own `-c constraints.txt`), so the distributions checked are the ones a new user would get.
The modules a command imports are read from the source with `ast`, from its entry module through
every project module it can import (function-local imports and `python -m` subprocesses included;
an import guarded by `except ImportError` is optional and not counted); each top-level module is
mapped to its distributions through this environment's installed metadata.

Resolving reads ~100 index pages per line (about a minute on a loaded machine, with pip's cache
warm), so the lines are resolved at once, in threads, and the tests run in the serial pass."""

from __future__ import annotations

import ast
import itertools
import json
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
import venv
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from tests.conftest import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
LOCAL = frozenset(
    p.removesuffix("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] if "*" in p
)
SCRIPTS = {
    name: target.split(":")[0].removesuffix(".__main__") for name, target in PROJECT["scripts"].items()
}
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
# A line that installs this project with extras: `pip install [options] [-e] ".[extras]"`.
_INSTALL = re.compile(r"pip install (?P<arguments>[^`\n]*?['\"](?:-e )?\.\[[a-z0-9,_-]+\]['\"])")
_BLOCK = re.compile(r"^\s*```bash\n(.*?)^\s*```", re.MULTILINE | re.DOTALL)
_COMMAND = re.compile(r"(?:^|[;&|(]\s*|\s)(?:python -m (?P<module>[a-z_.]+)|(?P<script>[a-z-]+))\b")


def _name(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _resolve_arguments(arguments: tuple[str, ...]) -> frozenset[str]:
    """The distributions `pip install ARGUMENTS` installs into a fresh virtual environment."""
    with tempfile.TemporaryDirectory(prefix="install-line-") as scratch:
        environment = Path(scratch) / "venv"
        venv.EnvBuilder(with_pip=False).create(environment)
        report = Path(scratch) / "report.json"
        command = [
            sys.executable, "-m", "pip", "--python", str(environment / "bin" / "python"),
            "install", "--dry-run", "--quiet", "--disable-pip-version-check",
            "--report", str(report), *arguments,
        ]  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
        # pip's last lines say why a resolution failed; the rest is this machine's index warnings.
        assert done.returncode == 0, f"pip install {' '.join(arguments)}: {done.stderr[-2000:]}"
        installs = json.loads(report.read_text())["install"]
    return frozenset(_name(item["metadata"]["name"]) for item in installs)


def _resolvable(arguments: tuple[str, ...]) -> tuple[str, ...]:
    # `-e` changes how the project is installed, not what it pulls in: one resolution serves both.
    return tuple(a for a in arguments if a != "-e")


_RESOLVED: dict[tuple[str, ...], frozenset[str]] = {}


def installed_by(arguments: tuple[str, ...]) -> frozenset[str]:
    key = _resolvable(arguments)
    if key not in _RESOLVED:
        _RESOLVED[key] = _resolve_arguments(key)
    return _RESOLVED[key]


def resolve_all(argument_lists: list[tuple[str, ...]]) -> None:
    """Resolves the lines side by side: the time goes to fetching index pages, not the CPU."""
    todo = sorted({_resolvable(a) for a in argument_lists} - _RESOLVED.keys())
    with ThreadPoolExecutor(max_workers=4) as pool:
        _RESOLVED.update(zip(todo, pool.map(_resolve_arguments, todo), strict=True))


def _source(module: str) -> tuple[Path, bool] | None:
    """A project module's file and whether it is a package's __init__."""
    base = ROOT / module.replace(".", "/")
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py"), False
    if (base / "__init__.py").is_file():
        return base / "__init__.py", True
    return None


def _optional(tree: ast.AST) -> set[int]:
    """Ids of the import nodes inside a `try` whose handlers catch ImportError."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            "ImportError" in ast.unparse(h.type or ast.Name("BaseException")) for h in node.handlers
        ):
            ids |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return ids


def _imports(module: str) -> set[str]:
    """Every module `module` can import: its imports (and `from X import y` as X.y too, y being
    maybe a module), its `importlib.import_module("...")` calls, and `-m X` in argument lists."""
    found = _source(module)
    if found is None:
        return set()
    path, is_package = found
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    optional = _optional(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).strip(".")
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = ast.unparse(node.func).rsplit(".", 1)[-1]
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
        elif isinstance(node, ast.List | ast.Tuple):
            words = [
                e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else "" for e in node.elts
            ]
            names |= {f"{b}.__main__" for a, b in itertools.pairwise(words) if a == "-m" and b}
    return names


@cache
def third_party_imports(entry: str) -> frozenset[str]:
    """The top-level third-party modules the project module `entry` can import, transitively."""
    seen: set[str] = set()
    third: set[str] = set()
    todo = [entry]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in _imports(module):
            top = name.split(".")[0]
            if top in LOCAL:
                # A module's package __init__ runs first.
                parts = name.split(".")
                todo += [".".join(parts[: i + 1]) for i in range(len(parts))]
            elif top not in sys.stdlib_module_names and top != "__future__":
                third.add(top)
    return frozenset(third)


def page_commands(text: str) -> set[str]:
    """The project's entry modules that a page's bash blocks run (`python -m X`, console scripts)."""
    entries: set[str] = set()
    for block in _BLOCK.findall(text):
        for match in _COMMAND.finditer(block.replace("\\\n", " ")):
            module = match["module"] or SCRIPTS.get(match["script"] or "")
            if module and module.split(".")[0] in LOCAL:
                entries.add(f"{module}.__main__" if _source(f"{module}.__main__") else module)
    return entries


def install_lines() -> list[tuple[str, tuple[str, ...]]]:
    """(page, the line's arguments after `pip install`) for every install line of the docs."""
    lines = []
    for page in PAGES:
        for match in _INSTALL.finditer(page.read_text()):
            lines.append((page.relative_to(ROOT).as_posix(), tuple(shlex.split(match["arguments"]))))
    # The Ray line first: it is the one issue 52 found broken.
    return sorted(lines, key=lambda line: "ray" not in line[0])


@cache
def _distributions() -> dict[str, list[str]]:
    return dict(packages_distributions())


def missing(entries: set[str], arguments: tuple[str, ...]) -> dict[str, list[str]]:
    """For each entry module, the third-party modules it imports that the line does not install."""
    installed = installed_by(arguments)
    gaps = {}
    for entry in sorted(entries):
        absent = [
            top
            for top in sorted(third_party_imports(entry))
            if not {_name(d) for d in _distributions().get(top, [top])} & installed
        ]
        if absent:
            gaps[entry] = absent
    return gaps


# The Ray line as issue 52 found it: the driver imports the server's modules and runs the exporter.
ISSUE_52_LINE = ("-c", "constraints.txt", "-e", ".[ray,tflite-runtime,sim]")


@pytest.fixture(scope="module")
def resolved() -> None:
    resolve_all([arguments for _, arguments in install_lines()] + [ISSUE_52_LINE])


def test_the_docs_have_install_lines_and_each_names_commands() -> None:
    lines = install_lines()
    assert lines[0][0] == "docs/how-to/simulate-on-ray.md"
    for page, arguments in lines:
        assert "constraints.txt" in arguments, f"{page}: pip install {shlex.join(arguments)} pins nothing"
        assert page_commands((ROOT / page).read_text()), f"{page} has an install line but no command"


@pytest.mark.serial
@pytest.mark.usefixtures("resolved")
@pytest.mark.parametrize(
    ("page", "arguments"), install_lines(), ids=lambda v: v if isinstance(v, str) else shlex.join(v)
)
def test_an_install_line_installs_what_its_page_commands_import(
    page: str, arguments: tuple[str, ...]
) -> None:
    gaps = missing(page_commands((ROOT / page).read_text()), arguments)
    assert not gaps, f"{page}: pip install {shlex.join(arguments)} leaves out {gaps}"


@pytest.mark.serial
@pytest.mark.usefixtures("resolved")
def test_the_check_finds_what_the_ray_line_of_issue_52_left_out() -> None:
    gaps = missing({"android_sim.__main__"}, ISSUE_52_LINE)
    assert {"pydantic", "tensorflow"} <= set(gaps["android_sim.__main__"])
