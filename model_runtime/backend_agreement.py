"""Does an exported model run alike on every installed backend? Each signature runs on each, from
a fresh load with the kernels a device uses (XNNPACK where the backend has it), with the same
inputs; any that fails on one backend and not another, or whose outputs differ beyond float
tolerance, is a problem. The exporter runs this on every export.

    python -m model_runtime.backend_agreement MODEL_DIR     (one JSON object on stdout)

Inputs are built from the manifest's specs alone: integer scalars 1 (one batch, one step),
integer tensors 0 (row, slot and class 0 exist in every model), float scalars 0.1 and float
tensors uniform in [0, 1) from a fixed seed. Every signature runs twice in name order, so the
second pass sees the variables the first wrote (set, trained, reset).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from contracts.manifest import MODEL_FILE, Manifest, load_manifest
from model_runtime.interpreter import ModelBackend, installed_backends, load_backend

RTOL, ATOL = 1e-4, 1e-5
PASSES = 2


@dataclass
class Agreement:
    backends: list[str]  # the backends the model ran on
    problems: list[str] = field(default_factory=list)  # one line each: trains on one, not another
    warnings: list[str] = field(default_factory=list)  # one line each: portable, with care


def signature_inputs(manifest: Manifest, name: str, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    inputs = {}
    for key, spec in sorted(manifest.signatures[name]["inputs"].items()):
        dtype = np.dtype(spec.dtype)
        if dtype.kind in "iu":
            value = np.full(spec.shape, 1 if spec.shape == () else 0, dtype)
        elif dtype.kind == "b":
            value = np.zeros(spec.shape, dtype)
        elif spec.shape == ():
            value = np.asarray(0.1, dtype)
        else:
            value = rng.uniform(0.0, 1.0, spec.shape).astype(dtype)
        inputs[key] = value
    return inputs


def _run_all(backend: ModelBackend, manifest: Manifest) -> dict[tuple[int, str], dict[str, np.ndarray] | str]:
    """(pass, signature) -> its outputs, or the error it raised."""
    results: dict[tuple[int, str], dict[str, np.ndarray] | str] = {}
    for run in range(PASSES):
        for index, name in enumerate(sorted(manifest.signatures)):
            try:
                signature = backend.signature(name)
                results[run, name] = signature(**signature_inputs(manifest, name, seed=100 * run + index))
            except (ValueError, RuntimeError) as e:
                results[run, name] = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return results


def _differs(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return True
    if a.dtype.kind == "f":
        return not np.allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
    return not np.array_equal(a, b)


def compare_backends(model_dir: Path) -> Agreement:
    manifest = load_manifest(model_dir, verify_model=False)
    content = (model_dir / MODEL_FILE).read_bytes()
    installed = installed_backends()
    agreement = Agreement(backends=[])
    runs: dict[str, dict[tuple[int, str], dict[str, np.ndarray] | str]] = {}
    for backend in installed:
        try:
            loaded = load_backend(content, backend)
        except (ValueError, RuntimeError) as e:
            agreement.problems.append(f"the model does not load on {backend}: {str(e).strip()[:300]}")
            continue
        agreement.backends.append(backend)
        runs[backend] = _run_all(loaded, manifest)
    if "compiled_model" in installed:
        from model_runtime.compiled_model_backend import aliased_outputs

        for name, names in aliased_outputs(content).items():
            agreement.warnings.append(
                f"signature {name!r}: outputs {', '.join(names)} are one tensor, which LiteRT's "
                "CompiledModel names once: a port must name its outputs from the model's signature defs"
            )
    if len(runs) < 2:
        return agreement
    reference, *others = runs
    for key in sorted(runs[reference]):
        run, name = key
        where = f"signature {name!r} (pass {run + 1})"
        failed = {b: runs[b][key] for b in runs if isinstance(runs[b][key], str)}
        if failed and len(failed) < len(runs):
            worked = sorted(set(runs) - set(failed))
            agreement.problems.append(
                f"{where} runs on {', '.join(worked)} and fails on "
                + "; ".join(f"{b}: {why}" for b, why in sorted(failed.items()))
            )
            continue
        if failed:
            agreement.warnings.append(
                f"{where} fails on every backend with the check's inputs: {failed[reference]}"
            )
            continue
        base = runs[reference][key]
        assert not isinstance(base, str)
        for other in others:
            outputs = runs[other][key]
            assert not isinstance(outputs, str)
            wrong = sorted(k for k in base if k not in outputs or _differs(base[k], outputs[k]))
            if wrong:
                agreement.problems.append(
                    f"{where} gives different {', '.join(wrong)} on {other} than on {reference} "
                    f"(beyond rtol {RTOL}, atol {ATOL})"
                )
    return agreement


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_runtime.backend_agreement", description=__doc__)
    parser.add_argument("model_dir", type=Path)
    args = parser.parse_args(argv)
    print(json.dumps(asdict(compare_backends(args.model_dir))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
