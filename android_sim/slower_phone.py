"""A simulated phone slower than the machine that simulates it: its tasks take longer.

A device class's `compute_slowdown` (`profiles.py`) says how much longer a task takes on that
class of phone than on this machine. The device's agent runs its tasks on this wrapper around
the fleet's shared `TaskRunner`: the task runs at this machine's speed, then the device waits
out the rest of the slower phone's time before it goes on (reports, or takes the next phase),
and its measured time is the slower phone's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from device_runtime.client_task import Task
from device_runtime.task_environment import TaskEnvironment
from device_runtime.task_runner import RunsTasks, TimedResult


class SlowerPhone:
    def __init__(self, runner: RunsTasks, slowdown: float) -> None:
        if not slowdown >= 1.0:
            raise ValueError(f"a phone's compute slowdown must be >= 1, got {slowdown}")
        self.runner = runner
        self.slowdown = slowdown

    async def run(
        self, kind: str, model_dir: Path, environment: TaskEnvironment, global_blob: bytes, task: Task
    ) -> TimedResult:
        timed = await self.runner.run(kind, model_dir, environment, global_blob, task)
        if self.slowdown <= 1.0:
            return timed
        await asyncio.sleep((self.slowdown - 1.0) * timed.seconds)
        return TimedResult(timed.result, timed.seconds * self.slowdown)
