"""A device's kept local parameters (FURL): per population and model, on the device, never uploaded.

In a population whose task config says `local_state: keep`, the device trains its own user
parameters jointly with the globals and keeps them across rounds and app restarts. They live
in the device's own example store file (its private `local_state` table): each save is one
SQLite transaction, so a crash leaves either the previous locals or the new ones, never half.
They are safetensors whose metadata names the population and the model they were trained
with. Locals trained against one model mean nothing to another: when the population's model
changed, or its local tensors changed shape, the kept ones are discarded and `KeptLocals.note`
says why. Nothing here goes over the wire; the orchestrator client never sees this module.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from safetensors import SafetensorError

from contracts.params import Params, ParamsError, check_params, decode_params, encode_params, read_metadata
from device_runtime.kept_locals_guard import KeptLocalsBounds
from device_runtime.task_environment import KeptState
from model_runtime.tflite_model import TFLiteModel

_KEY_PREFIX = "kept_locals/"
DEVICE_BOUNDS = KeptLocalsBounds()  # the app's; a server's task config cannot change them
_FRESH = ": starting from the model's initial values"


@dataclass(frozen=True)
class KeptLocals:
    params: Params
    tasks: int  # training tasks that trained them; 0 = the model's initial values
    note: str = ""  # why they start from the initial values ("" when kept ones were loaded)
    updated_at: float = 0.0  # wall time of the last save (0 for the initial values)

    @property
    def trained(self) -> bool:
        return self.tasks > 0


class LocalStateStore:
    """The kept local parameters of one population on one device, and the bounds (the device's,
    never the server's) on what one training task may do to them (`kept_locals_guard`)."""

    def __init__(self, store: KeptState, population: str, bounds: KeptLocalsBounds = DEVICE_BOUNDS) -> None:
        if not population:
            raise ValueError("a population name is needed to keep local parameters")
        self.store = store
        self.population = population
        self.bounds = bounds
        self._key = _KEY_PREFIX + population

    def _identity(self, model: TFLiteModel) -> dict[str, str]:
        manifest = model.manifest
        return {
            "population": self.population,
            "model_sha256": manifest.model_sha256,
            "local_params": json.dumps([s.to_json() for s in manifest.local_params]),
        }

    def load(self, model: TFLiteModel) -> KeptLocals:
        """The kept locals for `model`, or the model's initial values with the reason in `note`.

        Leaves the interpreter's local variables at the initial values (callers install what they use).
        """
        blob = self.store.load_local_state(self._key)
        model.reset_local()
        if blob is None:
            return KeptLocals(model.get_local(), 0, f"no kept local parameters yet{_FRESH}")
        fresh = model.get_local()
        try:
            stored = read_metadata(blob)
        except ParamsError as e:
            return KeptLocals(fresh, 0, f"discarded: kept local parameters unreadable ({e}){_FRESH}")
        reason = self._stale_reason(stored, self._identity(model))
        if reason:
            return KeptLocals(fresh, 0, f"discarded: {reason}{_FRESH}")
        try:
            params = decode_params(blob, model.manifest.local_params, "kept local parameters")
            tasks, updated_at = int(stored["tasks"]), float(stored["updated_at"])
        except (ParamsError, SafetensorError, KeyError, ValueError) as e:
            return KeptLocals(fresh, 0, f"discarded: kept local parameters unreadable ({e}){_FRESH}")
        return KeptLocals(params, tasks, "", updated_at)

    @staticmethod
    def _stale_reason(stored: dict[str, str], expected: dict[str, str]) -> str:
        if stored.get("population") != expected["population"]:
            return f"they belong to population {stored.get('population')!r}, not {expected['population']!r}"
        if stored.get("local_params") != expected["local_params"]:
            return (
                f"the model's local parameters changed shape (kept: {stored.get('local_params')}; "
                f"now: {expected['local_params']})"
            )
        if stored.get("model_sha256") != expected["model_sha256"]:
            return (
                f"the population's model changed (kept for {str(stored.get('model_sha256'))[:12]}..., "
                f"now {expected['model_sha256'][:12]}...)"
            )
        return ""

    def save(self, model: TFLiteModel, params: Params, tasks: int) -> None:
        """Keep `params` (checked against the manifest) as trained by `tasks` tasks; atomic."""
        if tasks < 1:
            raise ValueError(f"kept locals are saved after training, so tasks must be >= 1, got {tasks}")
        metadata = {**self._identity(model), "tasks": str(tasks), "updated_at": repr(time.time())}
        checked = check_params(params, model.manifest.local_params, "local parameters to keep")
        self.store.save_local_state(self._key, encode_params(checked, metadata))
