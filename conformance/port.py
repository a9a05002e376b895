"""What the runner asks of a device implementation (the port under test).

Every operation takes and returns plain data: bytes, integers, lists, JSON-shaped dicts and numpy
arrays. An operation that must refuse its input raises `Refused` with one of `ERROR_CLASSES`; a
port maps its own errors onto them. Another language's port implements the same operations behind
a small Python shim, or reads the vectors itself (docs/how-to/conformance-kit.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

# What a refusal is about: a manifest, a task config, a parameter payload (dense or row-sparse),
# or a secure-aggregation message or step.
ERROR_CLASSES = ("manifest", "task_config", "params", "protocol")

Json = dict[str, Any]


class Refused(Exception):
    """The port refused its input; `kind` is one of ERROR_CLASSES."""

    def __init__(self, kind: str, message: str) -> None:
        if kind not in ERROR_CLASSES:
            raise ValueError(f"error class must be one of {ERROR_CLASSES}, got {kind!r}")
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class SecureDevice(Protocol):
    """One device in one secure round, built from fixed secrets; its phases are called in order."""

    def advertise(self) -> Json:
        """The advertised keys as sent: {encryption_key, mask_key, self_mask_commitment} (base64)."""
        ...

    def share_keys(self, index: int, roster: dict[str, Json]) -> dict[str, Json]:
        """Encrypted shares per neighbour index (as a string), each {ciphertext, self_mask_share_commitment,
        mask_key_share_commitment} (base64); `roster` maps index strings to advertised keys."""
        ...

    def masked_input(self, quantized: np.ndarray, ciphertexts: dict[str, str]) -> bytes:
        """The masked input as sent: little-endian unsigned integers (4 bytes each when bits <= 32)."""
        ...

    def unmask(self, survivors: list[int]) -> Json:
        """{self_mask_shares: {owner: share}, mask_key_shares: {owner: share}} (base64 shares)."""
        ...


class Port(Protocol):
    # ---- wire formats ----
    def parse_manifest(self, document: Any) -> None: ...

    def parse_task_config(self, document: Any) -> Json:
        """The task config with every field resolved (defaults filled in)."""
        ...

    def decode_params(self, blob: bytes, specs: list[Json]) -> dict[str, np.ndarray]: ...

    def decode_sparse_delta(self, blob: bytes, specs: list[Json]) -> dict[str, Json]:
        """Per tensor {shape: [..], rows: [..], values: ndarray}; checked against `specs`."""
        ...

    def encode_sparse_delta(self, delta: dict[str, np.ndarray]) -> bytes: ...

    # ---- the task: the exported model's signatures ----
    def replay_signatures(self, model_dir: Path, calls: list[Json]) -> list[dict[str, np.ndarray]]:
        """Load model_dir/model.tflite once and make each call ({signature, inputs}) in order on it
        (the calls change its variables); the outputs of each call."""
        ...

    def task_delta(self, model_dir: Path, globals_blob: bytes, task: Json) -> bytes:
        """Run one FedRecon task (reconstruct on task["support"], measure and update on task["query"],
        task["config"]'s steps and rates) from the dense globals; the row-sparse delta it reports."""
        ...

    # ---- secure aggregation primitives ----
    def x25519_public(self, private: bytes) -> bytes: ...

    def agree(self, private: bytes, peer_public: bytes, purpose: bytes, context: str) -> bytes: ...

    def derive_key(self, secret: bytes, purpose: bytes, context: str) -> bytes: ...

    def encrypt(self, key: bytes, plaintext: bytes, associated: bytes) -> bytes: ...

    def decrypt(self, key: bytes, ciphertext: bytes, associated: bytes) -> bytes: ...

    def commitment(self, parts: list[bytes]) -> bytes: ...

    def shamir_shares(self, secret: int, coefficients: list[int], holders: list[int]) -> dict[int, int]: ...

    def shamir_reconstruct(self, shares: dict[int, int]) -> int: ...

    def expand_mask(self, seed: bytes, params: Json) -> np.ndarray:
        """The mask's residues modulo 2^bits, as uint64."""
        ...

    def quantize(self, vector: np.ndarray, params: Json, uniforms: np.ndarray) -> np.ndarray:
        """uint64 residues; `uniforms` are the stochastic rounding's draws in [0, 1), one per coordinate."""
        ...

    def neighbour_graph(self, roster: list[int], k: int, context: str) -> dict[int, list[int]]: ...

    def sign(self, private: bytes, message: bytes) -> bytes:
        """Ed25519 (deterministic) over `message` with a raw 32-byte private key."""
        ...

    def advertisement_message(self, context: str, keys: Json) -> bytes: ...

    def roster_digest(self, context: str, roster: dict[str, Json]) -> bytes: ...

    def statement_message(
        self, context: str, roster: bytes, inputs_sha256: bytes, missing: list[int]
    ) -> bytes: ...

    def view_message(
        self, context: str, roster: bytes, survivors: list[int], inputs_sha256: bytes
    ) -> bytes: ...

    def task_inputs_digest(self, inputs: Json) -> bytes: ...

    # ---- a device's side of a secure round ----
    def secure_device(self, params: Json, secrets: Json) -> SecureDevice:
        """`secrets`: {encryption_private, mask_private, self_mask_seed} (hex, 32 bytes each)."""
        ...

    def check_view(self, case: Json) -> None:
        """Refused('protocol') unless the device may reveal its shares for this view (the case's
        fields are described in the doc page)."""
        ...
