"""The architecture's import rules, read from the source with `ast`: every import, function-local
ones and `importlib.import_module("...")` included. The server never imports device code or the
exporter, device code never imports the exporter, the server or TensorFlow, the model runtime
(which both run) imports neither side nor TensorFlow, the contracts need
only the standard library, numpy and safetensors, secure aggregation stands on its own, nothing
but the tests imports the benchmarks, and no package's modules import each other in a circle."""

from __future__ import annotations

import ast
import sys

import pytest

from tests.conftest import ROOT

TENSORFLOW = ("tensorflow", "keras")
FORBIDDEN = {
    # The server relays devices' certificates; it must not be able to make one.
    "orchestrator": ("device_runtime", "android_sim", "model_export", "enrollment_authority", *TENSORFLOW),
    "device_runtime": ("model_export", "orchestrator", "android_sim", *TENSORFLOW),
    # Both sides run the exported model through it, so it belongs to neither.
    "model_runtime": ("device_runtime", "orchestrator", "android_sim", "model_export", *TENSORFLOW),
    "secure_aggregation": ("orchestrator", "device_runtime", "model_export", "enrollment_authority"),
    "enrollment_authority": ("orchestrator", "device_runtime", "android_sim", "model_export", *TENSORFLOW),
    # The kit checks a device port: its runner and adapter run without the fleet or TensorFlow
    # (its generator records from the real orchestrator, and exports its model in a subprocess).
    "conformance": ("android_sim", *TENSORFLOW),
}
CONTRACTS_MAY_IMPORT = frozenset({"contracts", "numpy", "safetensors", *sys.stdlib_module_names})
# Every package whose modules must not import each other in a circle.
PACKAGES = (*FORBIDDEN, "contracts", "model_export", "android_sim", "benchmarks")


def imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) for each import in `source`, a module of `package`; relative imports are
    the package's own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, package if node.level else node.module or package))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return sorted(found)


def violations(package: str, allowed: frozenset[str] | None = None) -> list[tuple[str, int, str]]:
    """(file, line, module) for each import in `package` that its rule forbids: a module under
    FORBIDDEN[package], or, when `allowed` is given, any module whose top level is not in it."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for line, module in imports(path.read_text(), package):
            top = module.split(".")[0]
            broken = top not in allowed if allowed is not None else top in FORBIDDEN[package]
            if broken:
                found.append((name, line, module))
    return found


def shown(found: list[tuple[str, int, str]], rule: str) -> str:
    return "\n".join(f"{name}:{line}: imports {module} ({rule})" for name, line, module in found)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_none_of_what_its_rule_forbids(package: str) -> None:
    forbidden = violations(package)

    rule = f"{package}/ must not import {', '.join(FORBIDDEN[package])}"
    assert not forbidden, f"forbidden imports:\n{shown(forbidden, rule)}"


def test_the_contracts_need_only_the_standard_library_numpy_and_safetensors() -> None:
    found = violations("contracts", CONTRACTS_MAY_IMPORT)

    assert (ROOT / "contracts" / "protocol.py").exists()  # the rule reads a package that is there
    rule = "contracts/ imports only the standard library, numpy and safetensors"
    assert not found, f"forbidden imports:\n{shown(found, rule)}"


def test_the_rule_sees_function_local_and_dynamic_imports() -> None:
    source = (
        "from __future__ import annotations\n"
        "from . import sibling\n"
        "def export():\n"
        "    import tensorflow as tf\n"
        "    from keras import layers\n"
        "    return importlib.import_module('model_export.manifest')\n"
    )

    found = imports(source, "device_runtime")

    assert found == [
        (1, "__future__"),
        (2, "device_runtime"),
        (4, "tensorflow"),
        (5, "keras"),
        (6, "model_export.manifest"),
    ]


def test_below_the_routes_the_orchestrator_never_imports_them() -> None:
    # The service layer, the state machine and the pipeline know nothing of HTTP: only the HTTP
    # layers themselves (the API's routes, the dashboard's pages) and the entry points (the
    # application's assembly, app.py, and the command line) reach the routes.
    found = [
        (name, line, module)
        for name, line, module in violations("orchestrator", frozenset())
        if module.startswith("orchestrator.api")
        and not name.startswith(("orchestrator/api/", "orchestrator/dashboard/"))
        and name not in ("orchestrator/app.py", "orchestrator/__main__.py")
    ]

    assert (ROOT / "orchestrator" / "service").is_dir()  # the rule reads the layer that is there
    rule = "only the HTTP layers (api/, dashboard/) and the entry points import the routes"
    assert not found, f"forbidden imports:\n{shown(found, rule)}"


# The orchestrator's layers, lowest first: a module imports from its own layer or lower ones only.
# The foundations are the database, the server's settings, the bounds and logs and metrics; the
# aggregation maths knows no population, a population no round, a round no service.
ORCHESTRATOR_LAYERS = (
    ("db", "settings", "limits", "setting_ranges", "devices", "migrate", "migrations", "observability"),
    ("aggregation",),
    ("populations",),
    ("rounds",),
    ("service",),
    ("api", "dashboard", "console"),
    ("app", "serve", "local", "__main__"),
)


def layer_of(module: str) -> int:
    """The layer of `orchestrator.X...` (or of the file orchestrator/X...), by its first part X."""
    first = module.replace("/", ".").split(".")[1].removesuffix(".py")
    for rank, names in enumerate(ORCHESTRATOR_LAYERS):
        if first in names:
            return rank
    raise AssertionError(f"orchestrator.{first} is in no layer of ORCHESTRATOR_LAYERS")


def test_the_orchestrator_imports_only_down_its_layers() -> None:
    found = [
        (name, line, module)
        for name, line, module in violations("orchestrator", frozenset())
        if module.startswith("orchestrator.")
        and layer_of(module) > layer_of(name.removesuffix(".py").removesuffix("/__init__"))
    ]

    assert (
        ROOT / "orchestrator" / "rounds" / "secure"
    ).is_dir()  # the rule reads the packages that are there
    rule = "a layer imports only from its own or lower ones: " + " < ".join(
        "/".join(n) for n in ORCHESTRATOR_LAYERS
    )
    assert not found, f"imports up the layers:\n{shown(found, rule)}"


def test_every_orchestrator_module_is_in_a_layer() -> None:
    for path in (ROOT / "orchestrator").iterdir():
        if path.name.startswith((".", "__pycache__")) or path.suffix not in (".py", ""):
            continue
        if path.name == "__init__.py":
            continue
        layer_of("orchestrator." + path.name)


def test_nothing_but_the_tests_imports_the_benchmarks() -> None:
    found = [
        (path.relative_to(ROOT).as_posix(), line, module)
        for path in sorted(ROOT.glob("*/**/*.py"))
        if path.relative_to(ROOT).parts[0] not in ("benchmarks", "tests", ".venv", "build")
        for line, module in imports(path.read_text(), path.relative_to(ROOT).parts[0])
        if module.split(".")[0] == "benchmarks"
    ]

    assert (ROOT / "benchmarks" / "__init__.py").exists()  # the rule reads a package that is there
    assert not found, f"forbidden imports:\n{shown(found, 'only benchmarks/ and tests/ import benchmarks')}"


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it loads, or its type checker reads (under `if`, `try`,
    `with`; `if TYPE_CHECKING:` too); not those inside functions, which run later."""
    found: list[ast.Import | ast.ImportFrom] = []
    blocks: list[ast.stmt] = list(tree.body)
    while blocks:
        node = blocks.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If | ast.With):
            blocks += [*node.body, *getattr(node, "orelse", [])]
        elif isinstance(node, ast.Try):
            blocks += [*node.body, *node.orelse, *node.finalbody]
            blocks += [s for handler in node.handlers for s in handler.body]
    return found


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the modules among `sources` it imports at module level. `sources`: each module's
    dotted name -> (its source, whether it is a package's `__init__`)."""
    graph: dict[str, set[str]] = {}
    for name, (source, is_package) in sources.items():
        targets: set[str] = set()
        for node in module_level_imports(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
                continue
            base = node.module or ""
            if node.level:  # relative: from the module's package, up `level - 1` more
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, *([node.module] if node.module else [])])
            targets |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
        graph[name] = {target for target in targets if target in sources and target != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return found


def package_sources(package: str) -> dict[str, tuple[str, bool]]:
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path.read_text(), is_package)
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_modules_of_a_package_import_each_other_in_a_circle(package: str) -> None:
    found = circles(import_graph(package_sources(package)))

    assert not found, f"{package}: import circles (module-level imports): {found}"


def test_the_circle_rule_sees_a_circle_through_a_type_checking_import_and_relative_imports() -> None:
    sources = {
        "pkg": ("", True),
        "pkg.config": ("from pkg.algorithm import task\n", False),
        "pkg.algorithm": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import config\n",
            False,
        ),
        "pkg.late": ("def f():\n    from pkg import config\n", False),
        "pkg.sub": ("from .. import late\n", True),
    }

    graph = import_graph(sources)

    assert graph["pkg.algorithm"] == {"pkg", "pkg.config"} and graph["pkg.sub"] == {"pkg", "pkg.late"}
    assert circles(graph) == [["pkg.algorithm", "pkg.config"]]  # not late's function-local import
