"""Every install line in the docs installs what the commands of its page import.

A fresh virtual environment per line would take minutes each (TensorFlow, Ray); this reads the
same facts instead: the distributions a line installs are pyproject.toml's base dependencies and
the line's extras, with everything they require (from the installed metadata); the modules a
command imports are read from the source with `ast`, from its entry module through every project
module it can import (function-local imports and `python -m` subprocesses included; an import
guarded by `except ImportError` is optional and not counted)."""

from __future__ import annotations

import ast
import itertools
import re
import sys
import tomllib
from functools import cache
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
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
_INSTALL = re.compile(
    r"pip install [^`\n]*?['\"](?:-e )?(?:\.|fedrecon-ondevice)\[(?P<extras>[a-z0-9,_-]+)\]['\"]"
)
_BLOCK = re.compile(r"^\s*```bash\n(.*?)^\s*```", re.MULTILINE | re.DOTALL)
_COMMAND = re.compile(r"(?:^|[;&|(]\s*|\s)(?:python -m (?P<module>[a-z_.]+)|(?P<script>[a-z-]+))\b")


def _name(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _requirement(text: str) -> tuple[str, frozenset[str], str]:
    """(name, extras, marker) of a requirement string."""
    found = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?[^;]*(?:;(.*))?", text)
    assert found, text
    extras = frozenset(e.strip() for e in (found[2] or "").split(",") if e.strip())
    return _name(found[1]), extras, (found[3] or "").strip()


def _applies(marker: str, extras: frozenset[str]) -> bool:
    """Whether a dependency's marker holds here: its `extra == "x"` clauses against `extras`, and
    the rest (python_version, sys_platform...) against this interpreter."""
    if not marker:
        return True
    wanted = re.findall(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
    if wanted and not any(_name(w) in extras for w in wanted):
        return False
    rest = re.sub(r"(and|or)?\s*extra\s*==\s*['\"][^'\"]+['\"]\s*(and|or)?", " ", marker).strip()
    if not rest:
        return True
    from packaging.markers import Marker  # pip's own, present wherever pip is

    return Marker(rest).evaluate({"extra": ""})


def installed_by(extras: frozenset[str]) -> set[str]:
    """The distributions `pip install ".[extras]"` installs: the base, the extras, and what they
    require, as far as this environment's metadata says."""
    todo = [_requirement(r) for r in PROJECT["dependencies"]]
    for extra in extras:
        assert extra in PROJECT["optional-dependencies"], f"no extra {extra!r} in pyproject.toml"
        todo += [_requirement(r) for r in PROJECT["optional-dependencies"][extra]]
    found: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted, _ = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        found.add(name)
        try:
            needs = requires(name) or []
        except PackageNotFoundError:
            continue
        for text in needs:
            dependency, its_extras, marker = _requirement(text)
            if _applies(marker, frozenset(map(_name, wanted))):
                todo.append((dependency, its_extras, ""))
    return found


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


def install_lines() -> list[tuple[str, frozenset[str]]]:
    lines = []
    for page in PAGES:
        for match in _INSTALL.finditer(page.read_text()):
            lines.append((page.relative_to(ROOT).as_posix(), frozenset(match["extras"].split(","))))
    return lines


@cache
def _distributions() -> dict[str, list[str]]:
    return dict(packages_distributions())


def missing(entries: set[str], extras: frozenset[str]) -> dict[str, list[str]]:
    """For each entry module, the third-party modules it imports that the extras do not install."""
    installed = installed_by(extras)
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


@pytest.mark.parametrize(
    ("page", "extras"), install_lines(), ids=lambda v: v if isinstance(v, str) else ",".join(sorted(v))
)
def test_an_install_line_installs_what_its_page_commands_import(page: str, extras: frozenset[str]) -> None:
    gaps = missing(page_commands((ROOT / page).read_text()), extras)
    assert not gaps, f"{page}: pip install '.[{','.join(sorted(extras))}]' leaves out {gaps}"


def test_the_check_finds_what_the_ray_line_of_issue_52_left_out() -> None:
    # The line as it was: the driver imports the server's modules and runs the exporter.
    gaps = missing({"android_sim.__main__"}, frozenset({"ray", "tflite-runtime", "sim"}))
    assert {"pydantic", "tensorflow"} <= set(gaps["android_sim.__main__"])
