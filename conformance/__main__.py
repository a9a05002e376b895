"""`python -m conformance`: check a device port against the kit; exit 1 if any case fails.

python -m conformance                                  # the Python device runtime
python -m conformance --command ./my-port-adapter      # a port speaking JSON lines (conformance/port.py)
"""

from __future__ import annotations

import argparse
import shlex

from conformance.port import CommandPort, Port
from conformance.python_port import PythonPort
from conformance.runner import SECTIONS, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--command",
        help="the port's adapter command (JSON lines on stdin/stdout); "
        "default: the Python device runtime in this process",
    )
    parser.add_argument(
        "--section", action="append", choices=SECTIONS, help="only these sections (repeatable) [all]"
    )
    parser.add_argument("--verbose", action="store_true", help="also list the cases that pass")
    args = parser.parse_args(argv)
    command = CommandPort(shlex.split(args.command)) if args.command else None
    port: Port = command or PythonPort()
    try:
        outcomes = run(port, tuple(args.section or SECTIONS))
    finally:
        if command is not None:
            command.close()
    failed = [o for o in outcomes if o.problem]
    for o in outcomes:
        if o.problem or args.verbose:
            print(
                f"{'FAIL' if o.problem else 'ok  '} {o.section}: {o.case}"
                + (f": {o.problem}" if o.problem else "")
            )
    print(f"{len(outcomes) - len(failed)} of {len(outcomes)} cases passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
