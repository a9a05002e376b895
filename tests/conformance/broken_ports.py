"""Deliberately broken device ports: each carries one fault a real port could have, and the kit
must catch it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save

from conformance.port import Json
from conformance.python_port import PythonPort, PythonSecureDevice
from secure_aggregation.device import DeviceSession


class _FlippedPairSession(DeviceSession):
    def _pairwise_mask(self, v: int) -> np.ndarray:
        # Adds where it must subtract and the reverse: the pair's masks no longer cancel.
        flipped: np.ndarray = np.negative(super()._pairwise_mask(v))
        return flipped


class _WrongSignDevice(PythonSecureDevice):
    session_class = _FlippedPairSession


class WrongMaskSign(PythonPort):
    secure_device_class = _WrongSignDevice


class _WrongNeighbourDevice(PythonSecureDevice):
    def share_keys(self, index: int, roster: dict[str, Json]) -> dict[str, Json]:
        shares = super().share_keys(index, roster)
        first, second = sorted(shares, key=int)[:2]
        # The shares made for one neighbour are sent to another.
        return {**shares, first: shares[second], second: shares[first]}


class ShareForWrongNeighbour(PythonPort):
    secure_device_class = _WrongNeighbourDevice


class UnsortedSparseRows(PythonPort):
    def encode_sparse_delta(self, delta: dict[str, np.ndarray]) -> bytes:
        tensors: dict[str, np.ndarray] = {}
        for name, value in delta.items():
            rows = np.flatnonzero(np.any(value.reshape(value.shape[0], -1) != 0, axis=1)).astype(np.int32)[
                ::-1
            ]
            tensors[f"{name}/rows"] = np.ascontiguousarray(rows)
            tensors[f"{name}/values"] = np.ascontiguousarray(value[rows], dtype=np.float32)
            tensors[f"{name}/shape"] = np.asarray(value.shape, dtype=np.int64)
        return save(tensors)


class StaleLearningRate(PythonPort):
    def task_delta(self, model_dir: Path, globals_blob: bytes, task: Json) -> bytes:
        # Trains at half the rate the task config sends (a port that reads a stale config).
        return super().task_delta(
            model_dir,
            globals_blob,
            {
                **task,
                "config": {
                    **task["config"],
                    "update_learning_rate": 0.5 * task["config"]["update_learning_rate"],
                },
            },
        )


class _NoCommitmentDevice(PythonSecureDevice):
    def advertise(self) -> Json:
        keys: dict[str, Any] = super().advertise()
        del keys["self_mask_commitment"]
        return keys


class MissingField(PythonPort):
    secure_device_class = _NoCommitmentDevice
