"""Rewrite the kit's vectors from fixed seeds: `python -m conformance.generate [--out DIR]`.

The model under vectors/task/model is exported once (`python -m conformance.export_model`) and
committed: a TensorFlow export is not byte-for-byte reproducible, everything else here is."""

from __future__ import annotations

import argparse
from pathlib import Path

from conformance import generate_http, generate_secure, generate_task, generate_wire
from conformance.runner import VECTORS


def generate(out: Path, *, http: bool = True) -> None:
    """`http`: also record the HTTP exchanges from a real orchestrator (their ids, tokens and
    times differ on each recording; everything else is the same bytes each time)."""
    generate_wire.generate(out / "wire")
    generate_secure.generate(out / "secure")
    generate_task.generate(out / "task")
    if http:
        generate_http.generate(out / "http")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.generate", description=__doc__)
    parser.add_argument("--out", type=Path, default=VECTORS, help="the vectors folder [the kit's own]")
    args = parser.parse_args(argv)
    generate(args.out)
    print(f"wrote the conformance vectors under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
