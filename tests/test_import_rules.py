"""The architecture's import rules, read from the source with `ast`: every import, function-local
ones and `importlib.import_module("...")` included. The server never imports device code or the
exporter, device code never imports the exporter, the server or TensorFlow, the model runtime
(which both run) imports neither side nor TensorFlow, the contracts need
only the standard library, numpy and safetensors, and secure aggregation stands on its own."""

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
}
CONTRACTS_MAY_IMPORT = frozenset({"contracts", "numpy", "safetensors", *sys.stdlib_module_names})


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
