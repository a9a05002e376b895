"""The device's core is the reference a mobile team ports: no simulator concept in it.

What only the simulated fleet needs (a slower phone's stretched task time, a store kept closed
between rounds, a shard, small privacy floors) lives in `android_sim/` and plugs into the core
through `device_runtime/task_environment.py`'s interfaces. Read from the source with `ast`: the
core's identifiers (names, attributes, arguments, definitions, imports) never name such a
concept, the core imports nothing of the simulator, and it does not lean on the desktop tools.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_import_rules import imports

# The desktop tools: a command line and a bulk importer, which the phone does not port. Every
# other module of device_runtime/ is the core.
DESKTOP_TOOLS = frozenset({"__main__.py", "examples_table.py"})
SIMULATOR_WORDS = re.compile(r"slowdown|idle|simulat|fleet|shard", re.IGNORECASE)


def identifiers(source: str) -> list[tuple[int, str]]:
    """(line, identifier) for each name the code defines or uses (comments and strings aside)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.append((node.lineno, node.name))
        elif isinstance(node, ast.arg):
            found.append((node.lineno, node.arg))
        elif isinstance(node, ast.keyword) and node.arg is not None:
            found.append((node.value.lineno, node.arg))
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, node.module or "")]
            found += [(node.lineno, alias.asname or alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.asname or alias.name) for alias in node.names]
    return found


def simulator_concepts(source: str) -> list[tuple[int, str]]:
    return sorted({(line, name) for line, name in identifiers(source) if SIMULATOR_WORDS.search(name)})


def core_modules() -> list[Path]:
    return [p for p in sorted((ROOT / "device_runtime").glob("*.py")) if p.name not in DESKTOP_TOOLS]


def test_every_desktop_tool_named_exists() -> None:
    present = {p.name for p in (ROOT / "device_runtime").glob("*.py")}
    assert present >= DESKTOP_TOOLS, f"not in device_runtime/: {sorted(DESKTOP_TOOLS - present)}"
    assert len(core_modules()) > 10


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: p.name)
def test_the_core_names_no_simulator_concept(path: Path) -> None:
    found = simulator_concepts(path.read_text())

    assert not found, "\n".join(
        f"device_runtime/{path.name}:{line}: {name!r} is a simulator concept: it belongs in android_sim/ "
        "and plugs in through device_runtime/task_environment.py"
        for line, name in found
    )


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: p.name)
def test_the_core_imports_neither_the_simulator_nor_the_desktop_tools(path: Path) -> None:
    tools = {f"device_runtime.{name.removesuffix('.py')}" for name in DESKTOP_TOOLS}
    found = [
        (line, module)
        for line, module in imports(path.read_text(), "device_runtime")
        if module.split(".")[0] == "android_sim" or module in tools
    ]

    shown = (f"device_runtime/{path.name}:{line}: imports {module}" for line, module in found)
    assert not found, "\n".join(shown)


def test_the_check_catches_what_the_core_held_before_the_task_environment() -> None:
    # The agent's signature and its runner's sleep as they were, and an import of the idle store.
    before = """
from android_sim.idle_store import IdleStore

async def participate(self, should_continue, *, compute_slowdown: float = 1.0) -> None:
    if isinstance(self.store, IdleStore):
        await asyncio.sleep((compute_slowdown - 1.0) * seconds)
"""
    found = {name for _, name in simulator_concepts(before)}

    assert found == {"android_sim.idle_store", "IdleStore", "compute_slowdown"}
    assert [m for _, m in imports(before, "device_runtime")] == ["android_sim.idle_store"]
