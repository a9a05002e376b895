"""A device's participation loop: check in, fetch the model and globals, run the task, report.

The interpreter work runs on a `TaskRunner` (worker threads), so one process can drive many
devices' network traffic on its event loop while a small pool does the maths.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from contracts.features import InvalidExamples
from contracts.manifest import Manifest, ManifestError, load_manifest
from contracts.mixing import (
    max_gradient_bytes,
    max_transfer_bytes,
    transferred_examples,
    transferred_gradient,
)
from contracts.params import ParamsError
from contracts.protocol import Assignment, Rejection
from contracts.task_config import TaskConfig
from device_runtime.client_task import Outcome, Task, TaskResult
from device_runtime.device_identity import DeviceIdentity
from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.privacy_policy import ALL_POPULATIONS, ParticipationLog, PolicyRefusal, PrivacyPolicy
from device_runtime.protocol_errors import InvalidAnswer, ProtocolError, RetryLater, ServerUnavailable
from device_runtime.secure_round import SecureParticipation, SecureRoundDriver
from device_runtime.task_environment import DeviceStore, Environment, RoundStorage, open_store
from device_runtime.task_runner import RunsTasks, TaskRunner
from model_runtime.tflite_model import ModelLoadError
from secure_aggregation.config import ProtocolError as SecureProtocolError
from secure_aggregation.config import RoundParameters

T = TypeVar("T")


@dataclass
class Participation:
    """What happened when the device tried to take part once."""

    # reported | refused (the server answered 4xx, e.g. a report not taken) | rejected (check-in
    # declined, or the server asked to come back later: 429, a long 503; after `retry_after_seconds`)
    # | declined (the round is below the device's privacy policy, or its daily cap is reached: the
    # detail names the floor; a held assignment is aborted) | aborted | vanished (stopped without
    # telling the server, as a phone that loses power or network does) | invalid_answer (the
    # server's answer broke the protocol: the detail says how)
    # | unreachable (no answer after all retries)
    status: str
    assignment: Assignment | None = None
    task: TaskResult | None = None
    retry_after_seconds: float = 0.0
    detail: str = ""
    server_answer: dict[str, Any] = field(default_factory=dict)
    task_seconds: float = 0.0  # compute time, as the runner measured it
    central_bytes: int = 0  # mixing: the centralized examples or central gradient downloaded for the task


class DeviceAgent:
    def __init__(
        self,
        client: OrchestratorClient,
        store: DeviceStore | RoundStorage,
        cache_dir: Path,
        population: str,
        *,
        backend: str | None = None,
        runner: RunsTasks | None = None,
        policy: PrivacyPolicy | None = None,
        identity: DeviceIdentity | None = None,
    ) -> None:
        """`store` is the device's example store, open, or a `RoundStorage` that the agent opens
        only once the device is accepted into a round. `runner` runs the tasks (default: a
        `TaskRunner` of one worker). `policy` is the app's (default: the production
        `PrivacyPolicy()`, secure rounds only); `identity` the device's certified signing key, which
        that policy requires in secure rounds."""
        self.client = client
        self.policy = policy or PrivacyPolicy()
        self.identity = identity
        self.store = store
        self.cache_dir = Path(cache_dir)
        self.population = population
        self.runner = runner or TaskRunner(1, backend=backend)
        self.assignment: Assignment | None = None  # the one held while participating
        self.central_bytes = 0  # mixing: bytes of centralized examples or gradient for the current task

    async def participate(
        self,
        task: str = "training",
        conditions: Mapping[str, bool] | None = None,
        should_continue: Callable[[], bool] = lambda: True,
        seed: int = 0,
        *,
        abort_when_interrupted: bool = True,
        phase_continues: Callable[[str], bool] | None = None,
    ) -> Participation:
        """One attempt. `should_continue` (the device's training conditions) is asked during and
        after the task, and a False answer aborts (or, with `abort_when_interrupted=False`, the
        device vanishes and the server finds out at the deadline).
        In a secure round `phase_continues(phase)` (default: `should_continue()`) is asked before
        each phase of the protocol.

        Whatever the server answers, the result is a `Participation`: a refusal, an answer that
        breaks the protocol (a model, manifest, parameters or task config the device cannot use
        included) or a server that does not answer becomes its status, and an assignment the device
        holds is aborted. The example store is only ever read."""
        self.assignment = None
        self.central_bytes = 0
        try:
            participation = await self._participate(
                task,
                conditions,
                should_continue,
                seed,
                abort_when_interrupted=abort_when_interrupted,
                phase_continues=phase_continues,
            )
            participation.central_bytes = self.central_bytes
            return participation
        except PolicyRefusal as e:
            return await self._give_up("declined", str(e))
        except InvalidAnswer as e:
            return await self._give_up("invalid_answer", e.message, e.assignment_id)
        except (ModelLoadError, ManifestError, ParamsError) as e:  # the model or globals it was sent
            return await self._give_up("invalid_answer", str(e))
        except RetryLater as e:
            return await self._give_up("rejected", str(e), retry_after_seconds=e.retry_after_seconds)
        except ProtocolError as e:
            return await self._give_up("refused", str(e))
        except ServerUnavailable as e:
            return await self._give_up("unreachable", str(e))
        finally:
            self.assignment = None

    async def _give_up(
        self, status: str, detail: str, assignment_id: str | None = None, retry_after_seconds: float = 0.0
    ) -> Participation:
        """The participation ends early; the assignment held (or named by a bad answer) is aborted."""
        held = self.assignment
        if held is not None:
            detail += await self._abort(held)
        elif assignment_id is not None:
            detail += await self._abort(assignment_id)
        return Participation(status, held, retry_after_seconds=retry_after_seconds, detail=detail)

    async def _abort(self, assignment: Assignment | str) -> str:
        """Abort on the device's own orchestrator; '' when it arrived, else why not (the round's
        deadline then frees the slot)."""
        try:
            if isinstance(assignment, str):
                await self.client.abort_assignment(assignment)
            else:
                await self.client.abort(assignment)
        except (InvalidAnswer, ProtocolError, ServerUnavailable) as e:
            return f" (the abort did not arrive: {e})"
        return ""

    async def _participate(
        self,
        task: str,
        conditions: Mapping[str, bool] | None,
        should_continue: Callable[[], bool],
        seed: int,
        *,
        abort_when_interrupted: bool,
        phase_continues: Callable[[str], bool] | None,
    ) -> Participation:
        log = ParticipationLog(self.store, self.population)
        device_log = ParticipationLog(self.store, ALL_POPULATIONS)
        log.check(self.policy)  # at the day's cap, the device does not even check in
        device_log.check(self.policy)
        answer = await self.client.checkin(self.population, self.store.count(), task, conditions)
        if isinstance(answer, Rejection):
            return Participation(
                "rejected", retry_after_seconds=answer.retry_after_seconds, detail=answer.reason
            )
        self.assignment = answer
        # Before anything of the round is fetched or sent: the mode, then (secure) the round's floors.
        self.policy.check_assignment(answer)
        if answer.secure_parameters is not None:
            with contextlib.suppress(SecureProtocolError):  # a malformed one: the driver says so
                self.policy.check_parameters(RoundParameters.from_json(answer.secure_parameters))
        # A store kept closed between rounds opens for the round only; the participation is
        # recorded before anything of the round goes out, off the event loop (a commit each).
        record = functools.partial(_record, log, device_log)
        opened = (
            self.store.session(record)
            if isinstance(self.store, RoundStorage)
            else open_store(self.store, record)
        )
        async with opened as store:
            return await self._take_part(
                answer, store, should_continue, seed, abort_when_interrupted, phase_continues
            )

    async def _take_part(
        self,
        answer: Assignment,
        store: DeviceStore,
        should_continue: Callable[[], bool],
        seed: int,
        abort_when_interrupted: bool,
        phase_continues: Callable[[str], bool] | None,
    ) -> Participation:
        """The round the device was accepted into: its task, then the report or the secure phases."""
        if answer.kind == "training" and answer.aggregation == "secure":
            # Keys and shares do not depend on the update: they go out while the device trains.
            driver = SecureRoundDriver(
                self.client,
                answer,
                self.policy,
                stays=phase_continues or (lambda phase: should_continue()),
                abort_when_leaving=abort_when_interrupted,
                identity=self.identity,
            )
            sharing = asyncio.create_task(driver.share())
            try:
                return await self._train(
                    answer,
                    store,
                    lambda: should_continue() and not driver.left,
                    seed,
                    abort_when_interrupted,
                    (driver, sharing),
                )
            finally:
                # The device stopped (or finished): its keys and shares go no further, and an
                # error of theirs that an earlier one cut short is not left unread.
                sharing.cancel()
                await asyncio.gather(sharing, return_exceptions=True)
        return await self._train(answer, store, should_continue, seed, abort_when_interrupted)

    async def _train(
        self,
        answer: Assignment,
        store: DeviceStore,
        should_continue: Callable[[], bool],
        seed: int,
        abort_when_interrupted: bool,
        secure: tuple[SecureRoundDriver, asyncio.Task[SecureParticipation | None]] | None = None,
    ) -> Participation:
        """Run the task, then report it, or, in a secure round, finish the round's phases."""
        model_dir = await self.client.model_dir(answer, self.cache_dir)
        blob = await self.client.global_params(answer)
        config = TaskConfig.from_json(answer.task_config)
        central, central_blob = await self._mixing_download(
            answer,
            model_dir,
            answer.central_examples_url,
            self.client.central_examples,
            max_transfer_bytes,
            transferred_examples,
        )
        try:
            gradient, gradient_blob = await self._mixing_download(
                answer,
                model_dir,
                answer.central_gradient_url,
                self.client.central_gradient,
                max_gradient_bytes,
                transferred_gradient,
            )
        except ServerUnavailable:
            # The server has no gradient for this version (503 after every retry, e.g. not finite):
            # a plain FedRecon update instead, so that the round can still commit.
            gradient, gradient_blob = None, None
        environment = Environment.of(store, should_continue)
        task = Task(config, self.population, seed, central, gradient, answer.central_gradient_weight or 0.0)
        timed = await self.runner.run(answer.kind, model_dir, environment, blob, task)
        result, seconds = timed.result, timed.seconds
        self.central_bytes = len(central_blob or b"") + len(gradient_blob or b"")
        if secure is not None and secure[0].left:  # the round went on without it, or it left a phase
            left = await secure[1]
            assert left is not None
            return _secure_participation(answer, result, seconds, left)
        if result.outcome is Outcome.COMPLETED and not should_continue():
            result = TaskResult(Outcome.INTERRUPTED, message="conditions changed before reporting")
        if result.outcome is not Outcome.COMPLETED:
            detail = f"{result.outcome.value}: {result.message}"
            if result.outcome is Outcome.INTERRUPTED and not abort_when_interrupted:
                return Participation("vanished", answer, result, detail=detail, task_seconds=seconds)
            lost = await self._abort(answer)
            # An abort that never arrived leaves the server to find out at the deadline, as for
            # a device that vanished: counted so, the device's and the server's tallies agree.
            status = "vanished" if lost else "aborted"
            return Participation(status, answer, result, detail=detail + lost, task_seconds=seconds)
        if secure is not None:
            assert result.delta is not None
            driver, sharing = secure
            manifest = load_manifest(model_dir, verify_model=False)
            outcome = await sharing or await driver.finish(
                manifest, result.delta, blob, central_examples=central_blob, central_gradient=gradient_blob
            )
            return _secure_participation(answer, result, seconds, outcome)
        try:
            if answer.kind == "training":
                assert result.delta is not None
                reply = await self.client.report_training(
                    answer, result.delta, result.num_examples, result.metrics
                )
            else:
                reply = await self.client.report_evaluation(answer, result.num_examples, result.metrics)
        except ProtocolError as e:  # e.g. 409: the round closed (target reached, or deadline) first
            return Participation("refused", answer, result, detail=str(e), task_seconds=seconds)
        return Participation(
            "reported", answer, result, server_answer=dataclasses.asdict(reply), task_seconds=seconds
        )

    async def _mixing_download(
        self,
        answer: Assignment,
        model_dir: Path,
        url: str | None,
        fetch: Callable[[Assignment, int], Awaitable[bytes]],
        limit: Callable[[Manifest], int],
        check: Callable[[bytes, Manifest], T],
    ) -> tuple[T | None, bytes | None]:
        """What a training assignment carries for mixing at `url` (example transfer's examples,
        gradient transfer's gradient): fetched within the model's `limit`, checked against the
        model by `check`, and the bytes as downloaded (a secure round's neighbours sign their
        digest); None when the assignment carries none. A payload that does not fit the model is
        an InvalidAnswer."""
        if url is None or answer.kind != "training":
            return None, None
        manifest = load_manifest(model_dir, verify_model=False)
        blob = await fetch(answer, limit(manifest))
        try:
            return check(blob, manifest), blob
        except (InvalidExamples, ParamsError) as e:
            raise InvalidAnswer(str(e), assignment_id=answer.assignment_id) from None


def _record(*logs: ParticipationLog) -> None:
    for log in logs:
        log.record()


def _secure_participation(
    answer: Assignment, result: TaskResult, seconds: float, secure: SecureParticipation
) -> Participation:
    """A secure round's outcome, with the task's result in place of a report."""
    return Participation(
        secure.status,
        answer,
        result,
        detail=f"{secure.phase}: {secure.detail}" if secure.detail else "",
        server_answer={"bytes_up": secure.bytes_up, "bytes_down": secure.bytes_down},
        task_seconds=seconds,
    )
