"""Why FedRecon trails the group rule on the generated sticker table: history sizes, and the
globals against the reconstruction.

    python -m benchmarks.sticker_gap --run runs/stickers-plain

`--run` is a `simulate` output directory (its simulation.json and global_params.safetensors) of
`model_export.models.stickers` on `python -m android_sim.stickers`' table (`--data`, the same
`--seed`). Each held-out device is served twice with the run's trained globals and settings:
1. from its own store, as `simulate` serves it, the table's ceilings beside it, each method's hit
   rate@10 on its newest shares per history size;
2. with its locals reconstructed on `--draws` fresh shares drawn from its **true taste** (the
   generator's: its packs, re-shared stickers, group and night habits; `stickers.draw_shares`),
   at the run's reconstruction settings and with more steps. If those top-10s reach the group
   rule, the history (the reconstruction's data) is what is missing; if not, the globals cannot
   express the taste (an item's popularity and its pack in one embedding of dimension 8).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from android_sim.hit_rates import HISTORY_BUCKETS
from android_sim.recommendations import HitRates
from android_sim.run import load_workload
from android_sim.run_config import RunConfig
from android_sim.simulation.ranking import keep_future, ranking_split, read_held_out, read_item_groups, score
from android_sim.stickers import StickerConfig, device_id, draw_shares, generate_with_tastes
from contracts.features import Examples
from contracts.params import decode_params
from contracts.task_config import TaskConfig
from device_runtime.examples_table import DeviceExamples

MORE_STEPS = {"reconstruction_max_epochs": 20, "reconstruction_max_steps": 400}


def by_history(found: HitRates) -> dict[str, dict[str, float | None]]:
    """Each method's hit rate@10 on the newest shares, overall and per history size, in %."""
    out: dict[str, dict[str, float | None]] = {}
    for method, figures in found.evaluation.methods.items():
        row: dict[str, float | None] = {"all": None if figures.newest is None else 100 * figures.newest.value}
        for bucket in HISTORY_BUCKETS:
            cell = figures.by_history[bucket]["newest"]
            row[bucket] = None if cell is None else 100 * cell.value
        out[method] = row
    return out


def measure(run: Path, data: Path, model_dir: Path, seed: int, draws: int) -> dict[str, Any]:
    body = json.loads((run / "simulation.json").read_text())
    config = RunConfig(work_dir=run / "gap", model_dir=model_dir, examples=data / "shares.csv")
    workload = load_workload(config, Console(quiet=True))
    devices = workload.devices
    held = read_held_out(data / "held_out.txt", [d.device_id for d in devices])
    split = ranking_split(len(devices), held, int(body["options"]["split_seed"]))
    past, future = keep_future(devices, split.test)
    groups = read_item_groups(data / "catalog.csv", workload.manifest)
    blob = (run / "global_params.safetensors").read_bytes()
    params = decode_params(blob, workload.manifest.global_params, "the run's globals")
    task = TaskConfig.from_json(body["options"]["task_config"])
    stores = run / "gap" / "stores"
    own = score(workload, past, split, future, params, task, stores, groups)
    assert own is not None
    sticker_config = StickerConfig(seed=seed)
    catalog, _, tastes = generate_with_tastes(sticker_config)
    index = {device_id(u): u for u in range(sticker_config.users)}
    truthful = list(past)
    for i in split.test:
        taste = tastes[index[devices[i].device_id]]
        drawn = draw_shares(catalog, sticker_config, taste, draws, np.random.default_rng((seed, i)))
        columns = {k: v.astype(np.int32) for k, v in drawn.items()}
        examples = Examples({**columns, "shared": np.ones(draws, np.float32)}).validated(
            workload.manifest.features
        )
        truthful[i] = DeviceExamples(devices[i].device_id, examples, np.arange(draws, dtype=np.float64))
    rows: dict[str, Any] = {"own history": by_history(own)}
    for label, extra in (("true taste", {}), ("true taste, more steps", MORE_STEPS)):
        chosen = TaskConfig.from_json({**task.to_json(), "max_examples": draws, **extra})
        found = score(workload, truthful, split, future, params, chosen, stores, None, ceilings=False)
        assert found is not None
        rows[label] = by_history(found)["personalized"]
    devices_by = {
        b: sum(1 for d in own.scored if len(d.future) and _bucket(d.history) == b) for b in HISTORY_BUCKETS
    }
    return {"rows": rows, "devices": devices_by, "draws": draws, "more_steps": MORE_STEPS}


def _bucket(history: int) -> str:
    return "1" if history == 1 else "2-4" if history <= 4 else "5+"


def print_table(found: dict[str, Any]) -> None:
    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    counts = found["devices"]
    print(
        "| hit rate@10, % | all | " + " | ".join(f"{b} ({counts[b]} devices)" for b in HISTORY_BUCKETS) + " |"
    )
    print("| --- | --- | " + " | ".join("---" for _ in HISTORY_BUCKETS) + " |")
    for method, row in found["rows"]["own history"].items():
        print(
            f"| {method} | {cell(row['all'])} | " + " | ".join(cell(row[b]) for b in HISTORY_BUCKETS) + " |"
        )
    for label in ("true taste", "true taste, more steps"):
        row = found["rows"][label]
        name = f"FedRecon, locals on {found['draws']} shares of the {label}"
        print(f"| {name} | {cell(row['all'])} | " + " | ".join(cell(row[b]) for b in HISTORY_BUCKETS) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sticker_gap", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--run", type=Path, required=True, help="a simulate output directory")
    parser.add_argument("--data", type=Path, default=Path("runs/stickers-data"))
    parser.add_argument("--model-dir", type=Path, default=Path("runs/stickers-model"))
    parser.add_argument("--seed", type=int, default=0, help="the table's generator seed")
    parser.add_argument("--draws", type=int, default=300, help="shares drawn from each true taste")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    for path in (args.run / "simulation.json", args.data / "shares.csv", args.model_dir):
        if not path.exists():
            print(
                f"error: {path} does not exist (see the module's docstring for the commands)", file=sys.stderr
            )
            return 2
    found = measure(args.run, args.data, args.model_dir, args.seed, args.draws)
    print_table(found)
    if args.json:
        args.json.write_text(json.dumps(found, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
