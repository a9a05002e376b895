"""The Python device runtime as a port: each operation calls the project's own pure functions
(contracts/, secure_aggregation/), so the kit checks the code the phone runs."""

from __future__ import annotations

import base64
import sys
from pathlib import Path
from typing import Any, cast

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from conformance.port import Json, Refused, SecureDevice
from contracts.features import Examples
from contracts.manifest import MODEL_FILE, Manifest, ManifestError, TensorSpec
from contracts.params import ParamsError, check_sparse_delta, decode_params, decode_sparse_delta
from contracts.params import encode_sparse_delta as encode_delta
from contracts.task_config import TaskConfig
from device_runtime.fedrecon_step import Halt, fedrecon_step
from model_runtime.interpreter import interpreter_class
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import TFLiteModel
from secure_aggregation import crypto, masks, quantization, shamir
from secure_aggregation.config import ProtocolError, RoundParameters
from secure_aggregation.device import DeviceSession
from secure_aggregation.identity import SigningKey
from secure_aggregation.identity import advertisement_message as signed_message
from secure_aggregation.messages import (
    AdvertisedKeys,
    ciphertexts_from_json,
    encode_vector,
    shares_to_json,
)
from secure_aggregation.neighbours import neighbour_graph
from secure_aggregation.view import (
    Confirmation,
    PartnerStatement,
    TaskInputs,
    View,
    check_view,
    roster_digest,
    statement_message,
    view_message,
)


def specs_of(specs: list[Json]) -> list[TensorSpec]:
    return [TensorSpec.from_json(s, "specs") for s in specs]


def tensor_of(spec: Json) -> np.ndarray:
    return np.asarray(spec["values"], dtype=spec["dtype"]).reshape(spec["shape"])


def examples_of(columns: Json) -> Examples:
    return Examples({name: tensor_of(spec) for name, spec in columns.items()})


def roster_of(roster: dict[str, Json]) -> dict[int, AdvertisedKeys]:
    return {int(i): AdvertisedKeys.from_json(keys) for i, keys in roster.items()}


class _Draws:
    """The stochastic rounding's draws, fixed by the vector (quantize asks a Generator for them)."""

    def __init__(self, uniforms: np.ndarray) -> None:
        self.uniforms = uniforms

    def random(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.uniforms.reshape(shape)


class PythonSecureDevice:
    """A `DeviceSession` whose secrets are the vector's instead of fresh random ones."""

    session_class: type[DeviceSession] = DeviceSession

    def __init__(self, params: Json, secrets: Json) -> None:
        self.params = RoundParameters.from_json(params)
        self.session = self.session_class(self.params)
        # The kit fixes what a phone draws at random, so the outputs can be compared.
        self.session._encryption_key = crypto.private_from_bytes(bytes.fromhex(secrets["encryption_private"]))
        self.session._mask_key = crypto.private_from_bytes(bytes.fromhex(secrets["mask_private"]))
        self.session._seed = bytes.fromhex(secrets["self_mask_seed"])

    def advertise(self) -> Json:
        return self.session.advertise().to_json()

    def share_keys(self, index: int, roster: dict[str, Json]) -> dict[str, Json]:
        try:
            return shares_to_json(self.session.share_keys(index, roster_of(roster)))
        except ProtocolError as error:
            raise Refused("protocol", str(error)) from None

    def masked_input(self, quantized: np.ndarray, ciphertexts: dict[str, str]) -> bytes:
        try:
            parsed = ciphertexts_from_json(ciphertexts, len(ciphertexts))
            return encode_vector(self.session.masked_input(quantized, parsed), self.params)
        except ProtocolError as error:
            raise Refused("protocol", str(error)) from None

    def unmask(self, survivors: list[int]) -> Json:
        try:
            return self.session.unmask(survivors).to_json()
        except ProtocolError as error:
            raise Refused("protocol", str(error)) from None


class PythonPort:
    secure_device_class: type[PythonSecureDevice] = PythonSecureDevice

    # ---- wire formats ----
    def parse_manifest(self, document: Any) -> None:
        try:
            Manifest.from_json(document)
        except ManifestError as error:
            raise Refused("manifest", str(error)) from None

    def parse_task_config(self, document: Any) -> Json:
        try:
            return TaskConfig.from_json(document).to_json()
        except (ValueError, TypeError) as error:
            raise Refused("task_config", str(error)) from None

    def decode_params(self, blob: bytes, specs: list[Json]) -> dict[str, np.ndarray]:
        try:
            return decode_params(blob, specs_of(specs), "params")
        except ParamsError as error:
            raise Refused("params", str(error)) from None

    def decode_sparse_delta(self, blob: bytes, specs: list[Json]) -> dict[str, Json]:
        try:
            delta = check_sparse_delta(decode_sparse_delta(blob), specs_of(specs), "delta")
        except ParamsError as error:
            raise Refused("params", str(error)) from None
        return {
            name: {"shape": list(t.shape), "rows": t.rows.tolist(), "values": t.values}
            for name, t in delta.items()
        }

    def encode_sparse_delta(self, delta: dict[str, np.ndarray]) -> bytes:
        return encode_delta(cast(dict[str, Any], delta))

    # ---- the task ----
    def replay_signatures(self, model_dir: Path, calls: list[Json]) -> list[dict[str, np.ndarray]]:
        _, interpreter_cls = interpreter_class()
        # The builtin kernels, as TFLiteModel(default_delegates=False) that wrote the vectors.
        resolver = sys.modules[interpreter_cls.__module__].OpResolverType
        interpreter = interpreter_cls(
            model_content=(model_dir / MODEL_FILE).read_bytes(),
            num_threads=1,
            experimental_op_resolver_type=resolver.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        )
        outputs = []
        for call in calls:
            runner = interpreter.get_signature_runner(call["signature"])
            inputs = {name: tensor_of(spec) for name, spec in call["inputs"].items()}
            outputs.append({k: np.array(v) for k, v in runner(**inputs).items()})
        return outputs

    def task_delta(self, model_dir: Path, globals_blob: bytes, task: Json) -> bytes:
        model = TFLiteModel(model_dir, default_delegates=False)
        model.set_global(decode_params(globals_blob, model.manifest.global_params, "globals"))
        config = TaskConfig.from_json(task["config"])
        support, query = (
            TaskBatches.pack([examples_of(b) for b in task[side]], model.manifest)
            for side in ("support", "query")
        )
        step = fedrecon_step(model, support, query, config, measured=query)
        if isinstance(step, Halt):
            raise RuntimeError(f"the kit's task halted ({step}); it must train")
        return encode_delta(cast(dict[str, Any], model.dense_delta(step.trained.update)))

    # ---- secure aggregation primitives ----
    def x25519_public(self, private: bytes) -> bytes:
        return crypto.public_bytes(crypto.private_from_bytes(private))

    def agree(self, private: bytes, peer_public: bytes, purpose: bytes, context: str) -> bytes:
        try:
            return crypto.agree(crypto.private_from_bytes(private), peer_public, purpose, context)
        except ProtocolError as error:
            raise Refused("protocol", str(error)) from None

    def derive_key(self, secret: bytes, purpose: bytes, context: str) -> bytes:
        return crypto.derive_key(secret, purpose, context)

    def encrypt(self, key: bytes, plaintext: bytes, associated: bytes) -> bytes:
        return crypto.encrypt(key, plaintext, associated)

    def decrypt(self, key: bytes, ciphertext: bytes, associated: bytes) -> bytes:
        try:
            return crypto.decrypt(key, ciphertext, associated)
        except ProtocolError as error:
            raise Refused("protocol", str(error)) from None

    def commitment(self, parts: list[bytes]) -> bytes:
        return crypto.commitment(*parts)

    def shamir_shares(self, secret: int, coefficients: list[int], holders: list[int]) -> dict[int, int]:
        return shamir.shares_from_coefficients(secret, coefficients, holders)

    def shamir_reconstruct(self, shares: dict[int, int]) -> int:
        return shamir.reconstruct(shares)

    def expand_mask(self, seed: bytes, params: Json) -> np.ndarray:
        round_params = RoundParameters.from_json(params)
        return masks.expand(seed, round_params).astype(np.uint64) & np.uint64(round_params.modulus_mask)

    def quantize(self, vector: np.ndarray, params: Json, uniforms: np.ndarray) -> np.ndarray:
        draws = cast(np.random.Generator, _Draws(uniforms))
        return quantization.quantize(vector, RoundParameters.from_json(params), draws)

    def neighbour_graph(self, roster: list[int], k: int, context: str) -> dict[int, list[int]]:
        return neighbour_graph(roster, k, context)

    def sign(self, private: bytes, message: bytes) -> bytes:
        return SigningKey(Ed25519PrivateKey.from_private_bytes(private)).sign(message)

    def advertisement_message(self, context: str, keys: Json) -> bytes:
        return signed_message(context, AdvertisedKeys.from_json(keys))

    def roster_digest(self, context: str, roster: dict[str, Json]) -> bytes:
        return roster_digest(context, roster_of(roster))

    def statement_message(
        self, context: str, roster: bytes, inputs_sha256: bytes, missing: list[int]
    ) -> bytes:
        return statement_message(context, roster, inputs_sha256, missing)

    def view_message(self, context: str, roster: bytes, survivors: list[int], inputs_sha256: bytes) -> bytes:
        return view_message(context, roster, survivors, inputs_sha256)

    def task_inputs_digest(self, inputs: Json) -> bytes:
        values = dict(inputs)
        for name in (
            "globals_sha256",
            "central_examples_sha256",
            "central_gradient_sha256",
            "manifest_sha256",
        ):
            if values.get(name) is not None:
                values[name] = bytes.fromhex(values[name])
        return TaskInputs(**values).digest()

    # ---- a device's side of a secure round ----
    def secure_device(self, params: Json, secrets: Json) -> SecureDevice:
        return self.secure_device_class(params, secrets)

    def check_view(self, case: Json) -> None:
        view = View(
            params=RoundParameters.from_json(case["params"]),
            graph={int(u): list(vs) for u, vs in case["graph"].items()},
            roster=bytes.fromhex(case["roster_digest"]),
            signing_keys={int(u): base64.b64decode(k) for u, k in case["signing_keys"].items()},
            index=case["index"],
            holds=frozenset(case["holds"]),
            inputs_sha256=bytes.fromhex(case["inputs_sha256"]),
            survivors=frozenset(case["survivors"]),
        )
        try:
            check_view(
                view,
                {int(u): Confirmation.from_json(c) for u, c in case["confirmations"].items()},
                {int(u): PartnerStatement.from_json(s) for u, s in case["statements"].items()},
            )
        except ProtocolError as error:
            raise Refused("protocol", str(error)) from None
