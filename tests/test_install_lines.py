"""Every install line in the docs installs what the commands of its page import.

Each line is resolved for real: a fresh virtual environment, then pip's `install --dry-run
--report` with the line's own arguments (the constraints, the extras) against the registry, which
gives the exact set of distributions the line would install there. The modules a command imports
are read from the source with `ast`, from its entry module through every project module it can
import (function-local imports and `python -m` subprocesses included; an import guarded by
`except ImportError` is optional and not counted), and mapped to their distributions with this
environment's metadata. A resolve is about a hundred index look-ups: 100 s for the Ray line alone
with a warm pip cache, 220 s for the four lines at once on a loaded 2-core machine; so the tests
that resolve are serial."""

from __future__ import annotations

import ast
import itertools
import json
import re
import shlex
import subprocess
import sys
import tomllib
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
# A line as the docs write it, in a clone: `pip install [-c constraints.txt] [-e] ".[extras]"`.
_INSTALL = re.compile(r"pip install (?P<arguments>[^`\n]*?['\"](?:-e )?\.\[(?P<extras>[a-z0-9,_-]+)\]['\"])")
_BLOCK = re.compile(r"^\s*```bash\n(.*?)^\s*```", re.MULTILINE | re.DOTALL)
_COMMAND = re.compile(r"(?:^|[;&|(]\s*|\s)(?:python -m (?P<module>[a-z_.]+)|(?P<script>[a-z-]+))\b")


def _name(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


# The line issue 52 found: the driver imports the server's modules and runs the exporter.
ISSUE_52_RAY_LINE = '-c constraints.txt -e ".[ray,tflite-runtime,sim]"'


def resolve(arguments: str, venv: Path) -> frozenset[str]:
    """The distributions `pip install ARGUMENTS`, run from the clone's root in the fresh virtual
    environment `venv`, installs: pip's own resolution (`--dry-run --report`)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    report = venv / "report.json"
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    quiet = ["--disable-pip-version-check", "--quiet"]
    command = [*pip, *quiet, "install", "--dry-run", "--report", str(report), *shlex.split(arguments)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    errors = [line for line in done.stderr.splitlines() if "is ignored" not in line]
    assert done.returncode == 0, f"pip install {arguments} does not resolve: " + "\n".join(errors[-5:])
    return frozenset(_name(item["metadata"]["name"]) for item in json.loads(report.read_text())["install"])


@pytest.fixture(scope="session")
def resolutions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, frozenset[str]]:
    """Every line resolved, at once: each resolve mostly waits on the registry."""
    workspace = tmp_path_factory.mktemp("install-lines")
    lines = sorted({arguments for _, arguments in install_lines()} | {ISSUE_52_RAY_LINE})
    with ThreadPoolExecutor(len(lines)) as pool:
        found = pool.map(lambda i: resolve(lines[i], workspace / f"venv-{i}"), range(len(lines)))
        return dict(zip(lines, found, strict=True))


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


def install_lines() -> list[tuple[str, str]]:
    """(page, the line's arguments after `pip install`), each distinct line of a page once."""
    lines: dict[tuple[str, str], None] = {}
    for page in PAGES:
        for match in _INSTALL.finditer(page.read_text()):
            lines[(page.relative_to(ROOT).as_posix(), match["arguments"])] = None
    return list(lines)


@cache
def _distributions() -> dict[str, list[str]]:
    return dict(packages_distributions())


def missing(entries: set[str], installed: frozenset[str]) -> dict[str, list[str]]:
    """For each entry module, the third-party modules it imports that no installed distribution
    provides."""
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


def test_the_docs_have_install_lines_and_each_names_commands() -> None:
    lines = install_lines()
    assert "docs/how-to/simulate-on-ray.md" in {page for page, _ in lines}
    for page, _ in lines:
        assert page_commands((ROOT / page).read_text()), f"{page} has an install line but no command"


@pytest.mark.serial
@pytest.mark.parametrize(("page", "arguments"), install_lines())
def test_an_install_line_installs_what_its_page_commands_import(
    page: str, arguments: str, resolutions: dict[str, frozenset[str]]
) -> None:
    gaps = missing(page_commands((ROOT / page).read_text()), resolutions[arguments])
    assert not gaps, f"{page}: pip install {arguments} leaves out {gaps}"


@pytest.mark.serial
def test_the_check_finds_what_the_ray_line_of_issue_52_left_out(
    resolutions: dict[str, frozenset[str]],
) -> None:
    gaps = missing({"android_sim.__main__"}, resolutions[ISSUE_52_RAY_LINE])
    assert {"pydantic", "tensorflow"} <= set(gaps["android_sim.__main__"])
