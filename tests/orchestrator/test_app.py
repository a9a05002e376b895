"""The application's start-up (orchestrator/app.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from orchestrator.local import PROJECT_ROOT
from tests.orchestrator.conftest import ADMIN_TOKEN

# A server process, as far as its start-up: the app's lifespan entered, then what the cyclic
# garbage collector sees. In a process of its own, so that nothing else has frozen objects.
START_UP = """
import asyncio, gc, json, sys
from orchestrator.app import create_app
from orchestrator.settings import Settings

app = create_app(Settings(database_url=sys.argv[1], admin_token=sys.argv[2]))

async def start() -> None:
    async with app.router.lifespan_context(app):
        print(json.dumps({"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())}))

asyncio.run(start())
"""


def test_what_start_up_made_is_out_of_the_garbage_collectors_sight(tmp_path: Path) -> None:
    # A full collection traversed every object start-up made (100-140 ms on this machine), and
    # the event loop stood still meanwhile; frozen, they are never traversed again.
    started = subprocess.run(
        [sys.executable, "-c", START_UP, f"sqlite:///{tmp_path / 'o.sqlite'}", ADMIN_TOKEN],
        cwd=PROJECT_ROOT,
        env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(started.stdout.strip().splitlines()[-1])

    assert seen["frozen"] > 10 * seen["tracked"]
