"""The service layer owns every transaction (orchestrator/service/__init__.py): a module of the
HTTP API parses and answers, and never opens a database session or transaction itself. Read from
the source with `ast`: a call to `.begin()`, `Session(...)` or `sessionmaker(...)`, or a `with`
that binds a session."""

from __future__ import annotations

import ast

from tests.conftest import ROOT

# Modules of orchestrator/api/ that still open their own sessions, to be moved into the service
# layer as the admin routes were (service/admin.py); this list only shrinks.
NOT_YET_IN_THE_SERVICE = frozenset(
    {
        "orchestrator/api/edge.py",
        "orchestrator/api/routes/artifacts.py",
        "orchestrator/api/routes/assignments.py",
        "orchestrator/api/routes/devices.py",
        "orchestrator/api/routes/health.py",
        "orchestrator/api/routes/populations.py",
    }
)
OPENERS = ("Session", "sessionmaker")


def sessions_opened(source: str) -> list[int]:
    """The lines of `source` that open a session or a transaction."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            transaction = isinstance(func, ast.Attribute) and func.attr in ("begin", "begin_nested")
            if transaction or (isinstance(func, ast.Name) and func.id in OPENERS):
                found.append(node.lineno)
        elif isinstance(node, ast.With | ast.AsyncWith):
            bound = [i.optional_vars for i in node.items if isinstance(i.optional_vars, ast.Name)]
            if any(name.id == "session" for name in bound):
                found.append(node.lineno)
    return sorted(set(found))


def opening_modules() -> dict[str, list[int]]:
    found = {}
    for path in sorted((ROOT / "orchestrator" / "api").rglob("*.py")):
        lines = sessions_opened(path.read_text())
        if lines:
            found[path.relative_to(ROOT).as_posix()] = lines
    return found


def test_no_api_module_opens_a_transaction_itself() -> None:
    found = {name: lines for name, lines in opening_modules().items() if name not in NOT_YET_IN_THE_SERVICE}

    assert (ROOT / "orchestrator" / "api" / "routes" / "admin.py").exists()  # the rule reads what is there
    assert not found, f"routes that open a transaction (move it into orchestrator/service/): {found}"


def test_the_modules_not_yet_moved_still_open_one() -> None:
    # So that a module moved into the service layer leaves the list, and the rule covers it again.
    assert set(opening_modules()) >= NOT_YET_IN_THE_SERVICE


def test_the_rule_sees_a_transaction_a_read_and_a_session_made_by_hand() -> None:
    source = (
        "def write(factory):\n"
        "    with factory.begin() as session:\n"
        "        pass\n"
        "def read(factory):\n"
        "    with factory() as session:\n"
        "        pass\n"
        "def by_hand(engine):\n"
        "    return Session(engine)\n"
        "def answer(factory):\n"
        "    return run_db(app, service.call, factory)\n"
    )

    assert sessions_opened(source) == [2, 5, 8]
