"""Regenerate the committed vectors: `python -m conformance.generate [--out DIR]`.

Fixed seeds throughout, so a run reproduces the committed files byte for byte (a test checks it).
The exported model under vectors/task/model is not regenerated here (TensorFlow's export is not
byte-stable): `python -m conformance.export_model` writes it, and everything else reads it."""

from __future__ import annotations

import argparse
from pathlib import Path

from conformance import generate_secure, generate_task, generate_wire
from conformance.vectors import VECTORS


def generate(root: Path) -> None:
    generate_wire.generate(root)
    generate_task.generate(root)
    generate_secure.generate(root)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m conformance.generate", description=__doc__)
    parser.add_argument(
        "--out", type=Path, default=VECTORS, help="where to write (default: the kit's vectors)"
    )
    args = parser.parse_args(argv)
    generate(args.out)
    print(f"wrote the conformance vectors under {args.out}")


if __name__ == "__main__":
    main()
