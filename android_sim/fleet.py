"""A fleet of simulated phones, each a real `device_runtime` with its own example store file.

Every device runs its own loop on one asyncio event loop: wait until its conditions allow
training (idle, charging, unmetered), check in, download, run the task on the shared
`TaskRunner` (a thread pool sized to the cores), take as long as its compute tier says, and
report, abort, or vanish. Requests go through the device's `SimulatedLink` (its bandwidth
and latency) to its own connection to the orchestrator, or to the in-process ASGI app.
A server that goes away is waited for: the device retries with backoff and carries on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import InitVar, dataclass, field
from pathlib import Path

import httpx

from android_sim.idle_store import IdleStore, store_slots
from android_sim.network import Connector, SimulatedLink
from android_sim.profiles import DeviceProfile, SimClock
from android_sim.slower_phone import SlowerPhone
from android_sim.small_cohorts import simulation_policy
from contracts.features import FeatureSpec
from device_runtime.agent import DeviceAgent, Participation
from device_runtime.device_identity import DeviceIdentity
from device_runtime.example_store import Event, ExampleStore
from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.privacy_policy import PrivacyPolicy
from device_runtime.task_runner import TaskRunner
from enrollment_authority.authority import EnrollmentAuthority

TRAINING, HELD_OUT = "training", "held-out"

# The secure phases a device asks `phase_continues` about (advertise, share keys, masked input, unmasking).
SECURE_PHASES = 4


@dataclass(frozen=True)
class DeviceSpec:
    """What the fleet needs to know to run a device."""

    role: str  # TRAINING devices train; HELD_OUT devices only evaluate (ReconEval)
    profile: DeviceProfile
    store_path: Path
    num_examples: int
    # The run wrote the store just now, examples only: it holds no participation log yet.
    new_store: bool = False


class Connection:
    """A device's way to the orchestrator while it talks to it: its simulated link over its own
    transport, an HTTP client and the orchestrator client with the device's token."""

    def __init__(
        self, device: SimDevice, base_url: str, connector: Connector, on_checkin: Callable[[float], None]
    ) -> None:
        device_class = device.profile.device_class
        inner, owned = connector.transport()
        self.link = SimulatedLink(
            inner,
            device_class.bandwidth_mbps,
            device_class.latency_ms,
            owns_inner=owned,
            on_checkin=on_checkin,
        )
        self.http = httpx.AsyncClient(transport=self.link, base_url=base_url, timeout=60.0)
        self.client = OrchestratorClient(
            base_url, device.token, http=self.http, attempts=6, backoff_seconds=0.2
        )

    async def close(self, device: SimDevice) -> None:
        """Hang up: the device keeps its token and its traffic's count, nothing of the connection."""
        device.token = self.client.token
        device.bytes_up += self.link.bytes_up
        device.bytes_down += self.link.bytes_down
        await self.http.aclose()  # and the link's transport with it


@dataclass(eq=False)
class SimDevice:
    """A simulated phone. Between its tasks it holds only these few fields (lean idle devices:
    a fleet's memory grows with the devices in rounds, not with the population); its
    connection exists while it talks to the orchestrator, its example store is open while it
    takes part in a round."""

    index: int
    role: str  # TRAINING devices train; HELD_OUT devices only evaluate (ReconEval)
    profile: DeviceProfile
    store_path: Path
    num_examples: int
    dial: Callable[[SimDevice], Connection] = field(repr=False)
    new_store: bool = False
    # The fleet's bound on stores open at once (`store_slots()`), kept by the device's store only.
    store_slots: InitVar[asyncio.Semaphore | None] = None
    device_id: str = ""
    token: str | None = None  # from enrollment: what identifies the device on each request
    # Its signing key, certified by the fleet's enrollment authority when it first takes part
    # (when the policy asks for one): an idle device holds none.
    identity: DeviceIdentity | None = None
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    trained: bool = False  # has reported a training task (a seen device, with kept locals if stateful)
    evaluated_round: int | None = None  # the last evaluation round it took part in (or tried to)
    bytes_up: int = 0  # over all its connections
    bytes_down: int = 0
    connection: Connection | None = field(default=None, repr=False)
    # Its example store, closed between rounds: the count and participation log a check-in reads.
    store: IdleStore = field(init=False, repr=False)

    def __post_init__(self, store_slots: asyncio.Semaphore | None) -> None:
        # The run's own scratch files: a phone's store waits for the disk at each commit and close
        # (a WAL checkpoint with fsyncs), which here cost the fleet's threads ~20% of a shard's samples.
        self.store = IdleStore(
            self.store_path, self.num_examples, new=self.new_store, durable=False, slots=store_slots
        )

    @property
    def task(self) -> str:
        return "training" if self.role == TRAINING else "evaluation"

    @property
    def client(self) -> OrchestratorClient:
        """The device's orchestrator client, connecting if it is not connected (e.g. to serve after
        the run; the connection then lasts until the fleet closes)."""
        if self.connection is None:
            self.connection = self.dial(self)
        return self.connection.client


@dataclass
class FleetStats:
    """What the devices saw, counted on the device side (the server keeps its own counters)."""

    outcomes: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    in_task: int = 0
    waiting_for_server: int = 0
    task_seconds: list[float] = field(default_factory=list)
    # Example transfer: bytes of centralized examples per training assignment that downloaded them.
    central_bytes: list[int] = field(default_factory=list)
    last_error: str = ""
    # Why participations ended short of a report: (status, the device's reason with its numbers
    # replaced by N), so that the run report can say which phase or condition costs the rounds.
    left_because: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    switched_off: int = 0  # devices still busy at the end of the run, cut off mid-request
    # How long check-ins took the server to answer, and how late the fleet's event loop woke from
    # a 50 ms sleep: counts per ms to 2 significant digits (bounded: shards send them often).
    checkin_ms: collections.Counter[float] = field(default_factory=collections.Counter)
    loop_lag_ms: collections.Counter[float] = field(default_factory=collections.Counter)

    def time_checkin(self, seconds: float) -> None:
        self.checkin_ms[_two_digits(seconds * 1e3)] += 1

    def checkin_percentile(self, q: float) -> float:
        """The check-ins' `q`-th percentile latency in ms (within 5%); 0 before any."""
        return percentile(self.checkin_ms, q)

    def loop_lag_percentile(self, q: float) -> float:
        """How late the event loop woke, `q`-th percentile in ms: a loop busy with too many
        devices is late for all of them (their requests wait as long)."""
        return percentile(self.loop_lag_ms, q)

    def count(self, role: str, status: str) -> int:
        return self.outcomes[(role, status)]

    def total(self, status: str) -> int:
        return sum(n for (_, s), n in self.outcomes.items() if s == status)


def reason(detail: str) -> str:
    """A participation's detail as a reason shared by many devices: its numbers as N, cut short."""
    return re.sub(r"\d+(\.\d+)?", "N", detail)[:160] or "(no detail)"


def _two_digits(ms: float) -> float:
    return float(f"{max(ms, 0.0):.2g}")


def percentile(counts: collections.Counter[float], q: float) -> float:
    """The `q`-th percentile of a histogram of values; 0 when it is empty."""
    total, seen = sum(counts.values()), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= q / 100 * total:
            return value
    return 0.0


LAG_PROBE_SECONDS = 0.05
# A fleet's devices make their first check-ins at about this rate (over at least 2 s): a fleet of
# 100,000 started within 2 s checked in 56,606 times in its first round; spread over a simulated
# day (60 s) its shards still held 29,000 check-ins each in flight on a loaded machine, and no
# round committed in 600 s. This server answers a few hundred check-ins a second.
FIRST_CHECKINS_PER_SECOND = 100.0
MIN_START_SECONDS = 2.0


class StopSwitch:
    """A role's stop: once set, it wakes every device sleeping under it at once.

    Each sleep has its own timer and future, so starting and ending one costs the same whatever
    the number of sleepers. Sleeping on one shared `asyncio.Event` with a timeout did not: each
    wake took the sleeper out of the event's list of waiters, a scan of every other sleeper
    (~1 ms a wake with 50,000 devices in a shard; more wakes a second than its event loop could
    do, so its lag grew until the devices accepted into a round no longer reported in time)."""

    def __init__(self) -> None:
        self._set = False
        self._sleepers: set[asyncio.Future[None]] = set()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        for woken in self._sleepers:
            _wake(woken)

    def clear(self) -> None:
        self._set = False

    def sleepers(self) -> int:
        return len(self._sleepers)

    async def sleep(self, seconds: float) -> None:
        """Sleep `seconds`, or until set."""
        if seconds <= 0 or self._set:
            return
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(seconds, _wake, woken)
        self._sleepers.add(woken)
        try:
            await woken
        finally:
            self._sleepers.discard(woken)
            timer.cancel()


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


def start_seconds(devices: int) -> float:
    """Over how long a fleet of `devices` makes its first check-ins (see FIRST_CHECKINS_PER_SECOND)."""
    return max(MIN_START_SECONDS, devices / FIRST_CHECKINS_PER_SECOND)


@dataclass(frozen=True)
class FleetOptions:
    population: str
    cooldown_hours: float = 2.0  # simulated hours a device rests after it took part
    server_wait_seconds: float = 2.0  # between attempts while the orchestrator is unreachable
    seed: int = 0
    # Stateful populations (FURL) evaluate on seen devices: training devices that have trained take
    # part in each open evaluation round (StandardEval on their newest examples) between trainings.
    seen_devices_evaluate: bool = False
    # The app's privacy policy on every simulated phone: small floors for a fleet of a few dozen.
    privacy_policy: PrivacyPolicy = field(default_factory=simulation_policy)
    # Certifies the simulated devices' signing keys (a new one per fleet when None): the fleet is
    # its client, as an app is the platform attestation service's; the orchestrator only relays.
    enrollment_authority: EnrollmentAuthority | None = None
    # Over how long the devices make their first check-ins; None: from the fleet's size
    # (`start_seconds`). A sharded fleet gives its shards the whole fleet's.
    start_seconds: float | None = None


def write_store(path: Path, events: Sequence[Event], features: Sequence[FeatureSpec]) -> None:
    """A new example store at `path` (replacing any) holding `events`."""
    path.unlink(missing_ok=True)
    for suffix in ("-wal", "-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    with ExampleStore(path, features, durable=False) as store:
        store.add(events)


class Fleet:
    def __init__(
        self,
        base_url: str,
        connector: Connector,
        devices: Sequence[DeviceSpec],
        cache_dir: Path,
        runner: TaskRunner,
        clock: SimClock,
        options: FleetOptions,
    ) -> None:
        self.base_url = base_url
        self.connector = connector
        self.cache_dir = cache_dir
        self.runner = runner
        self.clock = clock
        self.options = options
        # Certifies the devices' signing keys: the options' (shared by a run's shards) or the
        # fleet's own, when the policy requires certified rosters.
        self.authority = options.enrollment_authority
        if self.authority is None and options.privacy_policy.certified_roster:
            self.authority = EnrollmentAuthority()
        self.stats = FleetStats()
        self._rng = random.Random(options.seed)
        # Devices accepted into rounds wait for a store beyond this (the process's open files).
        self._store_slots = asyncio.Semaphore(store_slots())
        self.devices = [self._device(i, d) for i, d in enumerate(devices)]
        self._stop = {TRAINING: StopSwitch(), HELD_OUT: StopSwitch()}
        # The open evaluation round, as the run's monitor sees it through the admin API.
        self.evaluation_round: int | None = None
        self.training_paused = False  # seen devices only evaluate (the final evaluation)
        self._tasks: list[asyncio.Task[None]] = []

    def _device(self, index: int, spec: DeviceSpec) -> SimDevice:
        return SimDevice(
            index,
            spec.role,
            spec.profile,
            spec.store_path,
            spec.num_examples,
            self._dial,
            spec.new_store,
            self._store_slots,
        )

    def _dial(self, device: SimDevice) -> Connection:
        return Connection(device, self.base_url, self.connector, self._time_checkin)

    def _time_checkin(self, seconds: float) -> None:
        self.stats.time_checkin(seconds)  # the stats of now (a sharded fleet replaces its object)

    @contextlib.asynccontextmanager
    async def connected(self, device: SimDevice) -> AsyncIterator[OrchestratorClient]:
        """The device's client for one exchange (enrollment, a check-in and what follows it);
        the device hangs up after it, unless it was connected already."""
        if device.connection is not None:
            yield device.connection.client
            return
        connection = device.connection = self._dial(device)
        try:
            yield connection.client
        finally:
            device.connection = None
            await connection.close(device)

    def _identity(self, device: SimDevice) -> DeviceIdentity | None:
        """The device's certified signing key, made the first time it takes part."""
        if device.identity is None and self.authority is not None:
            device.identity = DeviceIdentity.enroll(self.authority.certify, self.authority.public_key)
        return device.identity

    async def enroll(self, concurrency: int = 32) -> None:
        limit = asyncio.Semaphore(concurrency)

        async def one(device: SimDevice) -> None:
            async with limit, self.connected(device) as client:
                device.device_id = await client.enroll()

        await asyncio.gather(*(one(d) for d in self.devices if not d.device_id))

    async def aclose(self) -> None:
        for device in self.devices:
            if device.connection is not None:
                connection, device.connection = device.connection, None
                await connection.close(device)

    def stop(self, roles: Sequence[str] = (TRAINING, HELD_OUT)) -> None:
        """Stop the devices of `roles` (each finishes or abandons what it is doing)."""
        for role in roles:
            self._stop[role].set()

    async def _sleep(self, device: SimDevice, seconds: float) -> None:
        """Sleep, but wake at once when the device's role is stopped."""
        await self._stop[device.role].sleep(seconds)

    async def run(self) -> None:
        """Run every device until `stop()` (or `switch_off`)."""
        for event in self._stop.values():
            event.clear()
        self._tasks = [asyncio.create_task(self._loop(d)) for d in self.devices]
        probe = asyncio.create_task(self._probe_loop_lag())
        try:
            outcomes = await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            probe.cancel()
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                raise outcome

    async def _probe_loop_lag(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asleep = loop.time()
            await asyncio.sleep(LAG_PROBE_SECONDS)
            self.stats.loop_lag_ms[_two_digits((loop.time() - asleep - LAG_PROBE_SECONDS) * 1e3)] += 1

    async def switch_off(self, grace_seconds: float) -> int:
        """Stop every device; those still busy after `grace_seconds` (e.g. waiting out a request's
        timeout and retries) are switched off mid-request, as phones are at the end of a run.
        Returns how many were."""
        self.stop()
        busy = [t for t in self._tasks if not t.done()]
        if busy:
            _, busy_set = await asyncio.wait(busy, timeout=grace_seconds)
            busy = list(busy_set)
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        self.stats.switched_off += len(busy)
        return len(busy)

    def _in_task(self, device: SimDevice, task: str) -> Callable[[], bool]:
        """Whether the device may go on with the task it checks in for now. Its conditions follow
        the task's own seconds (`SimClock.in_task`): what stops a task mid-way is the class's
        `dropout_probability`, the end of the run (or of its training, `training_paused`: a training
        task that went on would commit a round past `--rounds`), or the user in those seconds;
        compressed like the day, 27% of a secure round's devices left it in its four seconds."""
        now = self.clock.in_task()

        def eligible() -> bool:
            if task == "training" and self.training_paused:
                return False
            return device.profile.conditions(now()).eligible and not self._stop[device.role].is_set()

        return eligible

    def _should_continue(
        self, device: SimDevice, drops: bool, in_task: Callable[[], bool]
    ) -> Callable[[], bool]:
        calls = 0

        def should_continue() -> bool:
            nonlocal calls
            calls += 1
            # A dropout happens after the reconstruction began: the device stops mid-task.
            if drops and calls > 1:
                return False
            return in_task()

        return should_continue

    def _phase_continues(self, device: SimDevice, in_task: Callable[[], bool]) -> Callable[[str], bool]:
        """Secure aggregation's phases. The device's per-task dropout chance is spread over them
        (together they drop it as often as one task does, on top of the training's own chance):
        drawing the whole chance again at each phase dropped a secure participation about five
        times as often as a plaintext one. Staying longer in a round costs what it costs on a phone:
        the user picks it up, or the charging window ends, while it waits (`_in_task`)."""
        chance = 1.0 - (1.0 - device.profile.device_class.dropout_probability) ** (1.0 / SECURE_PHASES)

        def phase_continues(phase: str) -> bool:
            return self._rng.random() >= chance and in_task()

        return phase_continues

    def _task(self, device: SimDevice) -> str | None:
        """What the device checks in for next; None: nothing to do now."""
        if (
            self.options.seen_devices_evaluate
            and device.role == TRAINING
            and device.trained
            and self.evaluation_round is not None
            and device.evaluated_round != self.evaluation_round
        ):
            return "evaluation"
        if device.role == TRAINING and self.training_paused:
            return None
        return device.task

    async def _loop(self, device: SimDevice) -> None:
        device_class = device.profile.device_class
        # Spread the first check-ins, as a real fleet's are (its phones do not start at one instant).
        start = self.options.start_seconds
        if start is None:
            start = start_seconds(len(self.devices))
        await self._sleep(device, self._rng.random() * start)
        while not self._stop[device.role].is_set():
            task = self._task(device)
            if task is None:
                await self._sleep(device, 0.5)
                continue
            now = self.clock.now()
            conditions = device.profile.conditions(now)
            if not conditions.eligible:
                nxt = device.profile.next_eligible(now)
                wait = self.clock.day_seconds if nxt is None else self.clock.wall_seconds_until(nxt)
                await self._sleep(device, wait + self._rng.random() * 0.2)
                continue
            drops = self._rng.random() < device_class.dropout_probability
            vanishes = drops and self._rng.random() < device_class.vanish_share
            participation = await self._participate(device, task, conditions.as_dict(), drops, vanishes)
            if participation is None:
                await self._sleep(device, self.options.server_wait_seconds * (0.5 + self._rng.random()))
                continue
            device.outcomes[participation.status] += 1
            role = device.role if task == device.task else f"{device.role} ({task})"
            self.stats.outcomes[(role, participation.status)] += 1
            if participation.status not in ("reported", "rejected"):
                self.stats.left_because[(participation.status, reason(participation.detail))] += 1
            if task == "training" and participation.status == "reported":
                device.trained = True
            elif task == "evaluation" and device.role == TRAINING:
                assignment = participation.assignment
                device.evaluated_round = assignment.round_id if assignment else self.evaluation_round
            if participation.task_seconds:
                self.stats.task_seconds.append(participation.task_seconds)
            if participation.central_bytes:
                self.stats.central_bytes.append(participation.central_bytes)
            if participation.status == "rejected":
                await self._sleep(device, participation.retry_after_seconds * (0.5 + self._rng.random()))
            else:
                rest = self.options.cooldown_hours * 3_600 / self.clock.speedup
                await self._sleep(device, rest * (0.5 + self._rng.random()))

    async def _participate(
        self, device: SimDevice, task: str, conditions: dict[str, bool], drops: bool, vanishes: bool
    ) -> Participation | None:
        """One attempt; None when the orchestrator could not be reached (the device waits)."""
        self.stats.in_task += 1
        in_task = self._in_task(device, task)
        try:
            async with self.connected(device) as client:
                agent = DeviceAgent(
                    client,
                    device.store,  # opened only if the device is accepted into a round
                    self.cache_dir,
                    self.options.population,
                    runner=SlowerPhone(self.runner, device.profile.device_class.compute_slowdown),
                    policy=self.options.privacy_policy,
                    identity=self._identity(device),
                )
                participation = await agent.participate(
                    task,
                    conditions,
                    self._should_continue(device, drops, in_task),
                    seed=self._rng.getrandbits(31),
                    abort_when_interrupted=not vanishes,
                    phase_continues=self._phase_continues(device, in_task),
                )
            if participation.status == "unreachable":
                self.stats.waiting_for_server += 1
                self.stats.last_error = f"orchestrator unreachable: {participation.detail}"
                return None
            if participation.status in ("refused", "invalid_answer"):
                # e.g. the assignment's round closed while downloading; counted, and the device goes on.
                self.stats.last_error = f"device {device.index}: {participation.detail}"
            self.stats.waiting_for_server = 0
            return participation
        finally:
            self.stats.in_task -= 1
