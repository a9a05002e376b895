"""Where a secure fleet run's time went: per-phase durations and abandoned rounds by phase and reason.

    python -m android_sim run --aggregation secure --work-dir runs/secure
    python -m benchmarks.secure_fleet_phases runs/secure

Reads the run's `report.json` (wall time, the rounds with their `secure_<phase>_seconds` metrics)
and the orchestrator's SQLite file in the same directory (why each secure round was abandoned).
Prints medians and totals; a round's phases add up to its duration.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

PHASES = ("advertise", "share_keys", "masked_input", "consistency", "unmasking")


def _phases(round_: dict[str, Any]) -> dict[str, float]:
    metrics = round_["metrics"]
    return {p: metrics[f"secure_{p}_seconds"] for p in PHASES if f"secure_{p}_seconds" in metrics}


def _reason(outcome: str) -> str:
    """An abandon reason with its numbers taken out, so that like reasons count together."""
    return re.sub(r"\d+(\.\d+)?", "N", outcome)


def summarize(work_dir: Path) -> dict[str, Any]:
    report = json.loads((work_dir / "report.json").read_text())
    training = [r for r in report["rounds"] if r["kind"] == "training" and r["status"] != "open"]
    with sqlite3.connect(work_dir / "orchestrator.sqlite") as db:
        outcomes = dict(db.execute("SELECT round_id, outcome FROM secure_rounds").fetchall())
        # When each round's last check-in came: the advertise phase is the roster filling (check-ins
        # arriving), then waiting for the last devices' keys.
        last_checkin = dict(
            db.execute("SELECT round_id, MAX(created_at) FROM assignments GROUP BY round_id").fetchall()
        )
    out: dict[str, Any] = {"wall_seconds": report["seconds"]}
    for status in ("committed", "abandoned"):
        chosen = [r for r in training if r["status"] == status]
        durations = [r["closed_at"] - r["opened_at"] for r in chosen]
        by_phase = {p: [_phases(r)[p] for r in chosen if p in _phases(r)] for p in PHASES}
        out[status] = {
            "rounds": len(chosen),
            "seconds_total": sum(durations),
            "seconds_median": statistics.median(durations) if durations else None,
            "phase_seconds_median": {p: statistics.median(v) for p, v in by_phase.items() if v},
            "phase_seconds_total": {p: sum(v) for p, v in by_phase.items() if v},
        }
        fills = [last_checkin[r["id"]] - r["opened_at"] for r in chosen if r["id"] in last_checkin]
        keys = [
            _phases(r)["advertise"] - (last_checkin[r["id"]] - r["opened_at"])
            for r in chosen
            if r["id"] in last_checkin and "advertise" in _phases(r)
        ]
        out[status]["roster_fill_seconds_median"] = statistics.median(fills) if fills else None
        out[status]["advertise_after_last_checkin_seconds_median"] = statistics.median(keys) if keys else None
        if status == "committed":
            out[status]["survivors_median"] = (
                statistics.median(r["metrics"].get("secure_survivors", 0) for r in chosen) if chosen else None
            )
    abandoned = [r for r in training if r["status"] == "abandoned"]
    out["abandoned"]["by_phase"] = dict(
        Counter(list(_phases(r))[-1] if _phases(r) else "?" for r in abandoned)
    )
    out["abandoned"]["by_reason"] = dict(Counter(_reason(outcomes.get(r["id"], "")) for r in abandoned))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.secure_fleet_phases",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("work_dir", type=Path)
    args = parser.parse_args()
    print(json.dumps(summarize(args.work_dir), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
