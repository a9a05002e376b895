"""`python -m conformance [--port MODULE:CLASS] [--vectors DIR] [-v]`: run the kit against a port
(default: the Python device runtime); exit status 1 when any check fails."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import cast

from conformance.port import Port
from conformance.runner import failures, run_kit
from conformance.vectors import VECTORS

DEFAULT_PORT = "conformance.python_port:PythonPort"


def load_port(target: str) -> Port:
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        sys.exit(f"--port must be MODULE:CLASS (e.g. {DEFAULT_PORT}), got {target!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        sys.exit(f"--port {target}: cannot load it ({error})")
    return cast(Port, factory())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__)
    parser.add_argument("--port", default=DEFAULT_PORT, help=f"the port under test (default {DEFAULT_PORT})")
    parser.add_argument("--vectors", type=Path, default=VECTORS, help="the vectors' folder")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every check, not only failures")
    args = parser.parse_args(argv)
    if not (args.vectors / "wire").is_dir():
        sys.exit(
            f"--vectors {args.vectors}: no conformance vectors there (expected wire/ and secure_aggregation/)"
        )
    outcomes = run_kit(load_port(args.port), args.vectors)
    failed = failures(outcomes)
    for outcome in outcomes if args.verbose else failed:
        print(
            f"{'PASS' if outcome.passed else 'FAIL'} {outcome.name}"
            + (f": {outcome.problem}" if outcome.problem else "")
        )
    print(f"{len(outcomes) - len(failed)} of {len(outcomes)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
