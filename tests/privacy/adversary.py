"""A server adversary that searches: the device runtime's real secure-round code against a server
that chooses, phase by phase and per device, what to forward, withhold, corrupt, replay and announce.

Each device is a real `SecureRoundDriver` (the device runtime's own code, its real message formats:
the JSON bodies and masked-input bytes it would send over HTTP) with a certified identity and the
privacy policy it would have. The server is played here, in process: it runs the round honestly
except where a `Strategy` says otherwise (a roster with entries hidden or replaced by keys of its
own, ciphertexts withheld, corrupted or routed to the wrong holder, other globals for some devices,
a survivor set of its choosing for each device, confirmations and partner statements withheld or
relayed under another device's index). After the round it computes what it holds: every secret
whose shares reached the threshold, and for each device whose masked input it received, whether
it can strip every mask from that input alone, which it then does, to be sure the leak is real.

`search` runs strategies (exhaustively over small families of survivor views, then at random, then
by mutating the strategies that got the most secrets of one device) and reports coverage.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from android_sim.small_cohorts import simulation_policy
from contracts.protocol import Assignment
from device_runtime.device_identity import DeviceIdentity
from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.secure_round import SecureParticipation, SecureRoundDriver
from enrollment_authority.authority import EnrollmentAuthority
from secure_aggregation import crypto, masks, shamir
from secure_aggregation import survivors as survivor_rule
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import (
    SELF_MASK,
    DeviceSession,
    pairwise_purpose,
    pairwise_sign,
    round_graph,
    self_mask_commitment,
)
from secure_aggregation.identity import SignedAdvertisement, SigningKey
from secure_aggregation.messages import AdvertisedKeys, UnmaskingShares, b64, decode_vector
from secure_aggregation.quantization import clip, decode_signed
from secure_aggregation.view import PartnerStatement

ORDER = ("advertise", "share_keys", "masked_input", "consistency", "unmasking", "done")
AUTHORITY = EnrollmentAuthority()
SERVERS_AUTHORITY = EnrollmentAuthority()  # certifies whatever the server asks; no device trusts it
LENGTH = 48


@dataclass(frozen=True)
class Strategy:
    """What the server does differently from the protocol, per device (by device number 0..n-1;
    roster indices are numbers + 1). Empty: an honest server."""

    hide_from_roster: Mapping[int, frozenset[int]] = field(default_factory=dict)
    foreign_keys: Mapping[int, int] = field(default_factory=dict)  # device -> index given server keys
    withhold: Mapping[int, frozenset[int]] = field(default_factory=dict)  # holder -> senders withheld
    corrupt: Mapping[int, frozenset[int]] = field(default_factory=dict)  # holder -> senders corrupted
    misroute: Mapping[int, tuple[int, int]] = field(default_factory=dict)  # holder -> (sender, instead)
    other_globals: frozenset[int] = frozenset()  # devices given other globals
    views: Mapping[int, frozenset[int]] = field(default_factory=dict)  # device -> survivors shown
    hide_confirmations: Mapping[int, frozenset[int]] = field(default_factory=dict)
    hide_statements: Mapping[int, frozenset[int]] = field(default_factory=dict)
    misattribute: Mapping[int, tuple[int, int]] = field(default_factory=dict)  # device -> (a, b) swapped

    def describe(self) -> str:
        parts = {k: v for k, v in dataclasses.asdict(self).items() if v}
        return json.dumps(parts, default=lambda x: sorted(x) if isinstance(x, frozenset) else str(x))


@dataclass
class Outcome:
    statuses: list[str]
    details: list[str]
    leaked: dict[int, float]  # roster index -> cosine of what the server read with the device's update
    secrets: dict[int, int]  # roster index -> how many of its secrets (seed, pairwise seeds) the server holds
    committed: bool  # the honest sum could be unmasked from what devices revealed


class _Link(OrchestratorClient):
    """One device's connection, answered by the adversary in process (the messages as sent)."""

    def __init__(self, server: AdversaryServer, device: int) -> None:
        self.server, self.device = server, device
        self.received_json_bytes = 0

    async def secure_message(
        self, assignment: Assignment, phase: str, body: Any, until: str | None = None
    ) -> dict[str, Any]:
        return await self.server.message(self.device, phase, json.loads(json.dumps(body)))

    async def secure_masked_input(
        self, assignment: Assignment, body: bytes, until: str | None = None
    ) -> dict[str, Any]:
        return await self.server.message(self.device, "masked_input", body)

    async def secure_state(self, assignment: Assignment, until: str | None = None) -> dict[str, Any]:
        return await self.server.state(self.device, until)

    async def abort(self, assignment: Assignment) -> None:
        self.server.leave(self.device)


class AdversaryServer:
    def __init__(self, n: int, params: RoundParameters, strategy: Strategy) -> None:
        self.n, self.params, self.strategy = n, params, strategy
        self.phase = 0
        self.changed = asyncio.Event()
        self.active = set(range(n))
        self.sent: dict[str, dict[int, Any]] = {p: {} for p in ORDER}
        self.server_keys: dict[int, AdvertisedKeys] = {}  # index -> keys the server made for it

    # Phases advance once every device still taking part has sent the current phase's message.
    def _advance(self) -> None:
        while self.phase < len(ORDER) - 1:
            if not self.active <= set(self.sent[ORDER[self.phase]]):
                return
            self.phase += 1
            self.changed.set()
            self.changed = asyncio.Event()

    def leave(self, device: int) -> None:
        self.active.discard(device)
        self._advance()

    async def message(self, device: int, phase: str, body: Any) -> dict[str, Any]:
        name = {"keys": "advertise", "shares": "share_keys", "partners": "partners"}.get(phase, phase)
        self.sent.setdefault(name, {})[device] = body
        if name != "partners":
            self._advance()
        return {"index": device + 1} if name == "advertise" else {"accepted": True}

    async def state(self, device: int, until: str | None) -> dict[str, Any]:
        wanted = ORDER.index(until) if until in ORDER else self.phase
        while self.phase < wanted:
            await self.changed.wait()
        phase = ORDER[self.phase]
        out: dict[str, Any] = {"phase": phase, "round_status": "open", "outcome": None, "index": device + 1}
        out["parameters"] = self.params.to_json()
        if phase == "share_keys":
            out["roster"] = self.roster_for(device)
        elif phase == "masked_input":
            out["ciphertexts"] = self.ciphertexts_for(device)
        elif phase == "consistency":
            out["survivors"] = sorted(self.view_of(device))
        elif phase == "unmasking":
            out.update(self.unmasking_for(device))
        return out

    def roster_for(self, device: int) -> dict[str, Any]:
        roster = {str(d + 1): ad for d, ad in self.sent["advertise"].items()}
        for hidden in self.strategy.hide_from_roster.get(device, frozenset()):
            if hidden != device:
                roster.pop(str(hidden + 1), None)
        replaced = self.strategy.foreign_keys.get(device)
        if replaced is not None and replaced != device and str(replaced + 1) in roster:
            if replaced + 1 not in self.server_keys:
                self.server_keys[replaced + 1] = DeviceSession(self.params).advertise()
            key = SigningKey()
            certificate = SERVERS_AUTHORITY.certify(key.public)
            keys = self.server_keys[replaced + 1]
            roster[str(replaced + 1)] = SignedAdvertisement.sign(
                key, certificate, self.params.context, keys
            ).to_json()
        return roster

    def ciphertexts_for(self, holder: int) -> dict[str, str]:
        out: dict[str, str] = {}
        for sender, shares in self.sent["share_keys"].items():
            entry = shares.get(str(holder + 1))
            if entry is not None and sender not in self.strategy.withhold.get(holder, frozenset()):
                out[str(sender + 1)] = entry["ciphertext"]
        for sender in self.strategy.corrupt.get(holder, frozenset()):
            if str(sender + 1) in out:
                raw = bytearray(base64.b64decode(out[str(sender + 1)]))
                raw[-1] ^= 1
                out[str(sender + 1)] = b64(bytes(raw))
        misrouted = self.strategy.misroute.get(holder)
        if misrouted is not None:
            sender, instead = misrouted
            other = self.sent["share_keys"].get(sender, {})
            for holder_key, entry in other.items():
                if holder_key != str(holder + 1) and int(holder_key) - 1 == instead:
                    out[str(sender + 1)] = entry["ciphertext"]
        return out

    def honest_survivors(self) -> frozenset[int]:
        statements = {d + 1: PartnerStatement.from_json(s) for d, s in self.sent.get("partners", {}).items()}
        senders = {d + 1 for d in self.sent["masked_input"]}
        roster = sorted(d + 1 for d in self.sent["advertise"])
        graph = round_graph(self.params, roster)
        kept = {i: s for i, s in statements.items() if i in senders}
        return survivor_rule.choose(graph, kept).survivors

    def view_of(self, device: int) -> frozenset[int]:
        shown = self.strategy.views.get(device)
        return self.honest_survivors() if shown is None else frozenset(i + 1 for i in shown)

    def unmasking_for(self, device: int) -> dict[str, Any]:
        confirmations = {
            str(d + 1): c
            for d, c in self.sent["consistency"].items()
            if d not in self.strategy.hide_confirmations.get(device, frozenset())
        }
        statements = {
            str(d + 1): s
            for d, s in self.sent.get("partners", {}).items()
            if d not in self.strategy.hide_statements.get(device, frozenset())
        }
        swapped = self.strategy.misattribute.get(device)
        if swapped is not None:
            a, b = (str(x + 1) for x in swapped)
            if a in statements and b in statements:
                statements[a], statements[b] = statements[b], statements[a]
        return {
            "survivors": sorted(self.view_of(device)),
            "confirmed": sorted(int(i) for i in confirmations),
            "confirmations": confirmations,
            "statements": statements,
        }


def _assignment(n: int, params: RoundParameters) -> Assignment:
    return Assignment(
        assignment_id="a" * 32,
        round_id=1,
        kind="training",
        deadline=0.0,
        seconds_left=60.0,
        model_version=0,
        artifact_sha256="0" * 64,
        artifact_url="/v1/artifacts/x",
        params_url="/v1/params/x",
        manifest_url="/v1/manifest/x",
        report_url="/v1/report/x",
        abort_url="/v1/abort/x",
        task_config={},
        aggregation="secure",
        secure_url="/v1/assignments/x/secure",
        secure_parameters=params.to_json(),
    )


def round_parameters(n: int, threshold: float = 0.5, neighbours: int = 0) -> RoundParameters:
    return RoundParameters(
        context=f"adversary/{random.getrandbits(64)}",
        vector_length=LENGTH,
        bits=32,
        clip_norm=1.0,
        max_summands=n,
        neighbours=neighbours,
        threshold=threshold,
        min_survivors=3,
    )


def play(strategy: Strategy, n: int = 5, threshold: float = 0.5, seed: int = 0) -> Outcome:
    """One round of `n` real device drivers against the server playing `strategy`."""
    return asyncio.run(_play(strategy, n, threshold, seed))


async def _play(strategy: Strategy, n: int, threshold: float, seed: int) -> Outcome:
    params = round_parameters(n, threshold)
    server = AdversaryServer(n, params, strategy)
    rng = np.random.default_rng(seed)
    updates = [rng.normal(0, 0.2, LENGTH) for _ in range(n)]
    policy = simulation_policy("secure", min_summands=3, min_threshold=0.25, certified_roster=True)
    drivers = [
        SecureRoundDriver(
            _Link(server, d),
            _assignment(n, params),
            policy,
            identity=DeviceIdentity.enroll(AUTHORITY.certify, AUTHORITY.public_key),
        )
        for d in range(n)
    ]

    async def device(d: int) -> SecureParticipation:
        try:
            left = await drivers[d].share()
            if left is not None:
                return left
            blob = b"other globals" if d in strategy.other_globals else b"globals"
            inputs = drivers[d].task_inputs(blob, None, None)
            return await drivers[d].finish_vector(updates[d], inputs)
        finally:
            server.leave(d)

    results = await asyncio.wait_for(asyncio.gather(*(device(d) for d in range(n))), timeout=60)
    return _knowledge(server, params, updates, results)


def _reconstruct(shares: Mapping[int, bytes], t: int) -> bytes | None:
    if len(shares) < t:
        return None
    chosen = dict(sorted(shares.items())[:t])
    value = shamir.reconstruct({x: shamir.share_from_bytes(s) for x, s in chosen.items()})
    return value.to_bytes(crypto.KEY_BYTES, "big") if value < 1 << (8 * crypto.KEY_BYTES) else None


@dataclass(frozen=True)
class Reading:
    """What the server holds of one device whose masked input it received."""

    secrets: int  # its self-mask seed (1 if held) plus the pairwise seeds with its partners held
    partners: int  # the partners it masked with
    unmasked: np.ndarray | None  # its input with every mask stripped (quantized, signed), if possible


def server_knowledge(
    params: RoundParameters,
    advertised: Mapping[int, AdvertisedKeys],
    roster_of: Callable[[int], list[int]],
    answers: Mapping[int, UnmaskingShares],
    statements: Mapping[int, PartnerStatement],
    masked_inputs: Mapping[int, bytes],
) -> dict[int, Reading]:
    """From everything devices sent (their advertised keys, the roster indices each was shown,
    their unmasking answers, partner statements and masked inputs, by roster index): every secret
    whose shares reached its threshold, and what that lets the server read of each masked input."""
    seeds: dict[int, bytes] = {}
    mask_keys: dict[int, Any] = {}
    for owner, keys in advertised.items():
        # The owner's neighbourhood as it saw its roster: its shares went to those devices.
        t = params.shamir_threshold(len(round_graph(params, roster_of(owner))[owner]))
        seed_shares = {
            h: a.self_mask_shares[owner] for h, a in answers.items() if owner in a.self_mask_shares
        }
        seed = _reconstruct(seed_shares, t)
        if seed is not None and self_mask_commitment(seed, params.context) == keys.self_mask_commitment:
            seeds[owner] = seed
        key_shares = {h: a.mask_key_shares[owner] for h, a in answers.items() if owner in a.mask_key_shares}
        key = _reconstruct(key_shares, t)
        if key is not None:
            private = crypto.private_from_bytes(key)
            if crypto.public_bytes(private) == keys.mask_key:
                mask_keys[owner] = private
    readings: dict[int, Reading] = {}
    for u, body in masked_inputs.items():
        partners = set(round_graph(params, roster_of(u))[u]) - set(statements[u].missing)
        pairwise = {v for v in partners if u in mask_keys or v in mask_keys}
        unmasked = None
        if u in seeds and pairwise == partners:
            unmasked = _unmask_alone(params, body, u, seeds[u], partners, mask_keys, advertised)
        readings[u] = Reading(int(u in seeds) + len(pairwise), len(partners), unmasked)
    return readings


def cosine(read: np.ndarray, update: np.ndarray, params: RoundParameters) -> float:
    truth = clip(update, params.clip_norm)
    return float(read @ truth / (np.linalg.norm(read) * np.linalg.norm(truth) + 1e-12))


def _knowledge(
    server: AdversaryServer,
    params: RoundParameters,
    updates: list[np.ndarray],
    results: Iterable[SecureParticipation],
) -> Outcome:
    results = list(results)
    readings = server_knowledge(
        params,
        {d + 1: AdvertisedKeys.from_json(a["keys"]) for d, a in server.sent["advertise"].items()},
        lambda owner: sorted(int(i) for i in server.roster_for(owner - 1)),
        {d + 1: UnmaskingShares.from_json(a, 64) for d, a in server.sent["unmasking"].items()},
        {d + 1: PartnerStatement.from_json(s) for d, s in server.sent.get("partners", {}).items()},
        {d + 1: body for d, body in server.sent["masked_input"].items()},
    )
    leaked = {
        u: cosine(r.unmasked, updates[u - 1], params) for u, r in readings.items() if r.unmasked is not None
    }
    return Outcome(
        [r.status for r in results],
        [r.detail for r in results],
        leaked,
        {u: r.secrets for u, r in readings.items()},
        all(r.status == "reported" for r in results),
    )


def _unmask_alone(
    params: RoundParameters,
    body: bytes,
    u: int,
    seed: bytes,
    partners: set[int],
    mask_keys: Mapping[int, Any],
    roster: Mapping[int, AdvertisedKeys],
) -> np.ndarray:
    """Device u's input with every mask stripped by what the server holds (signed integers)."""
    total = decode_vector(body, params).astype(masks.sum_dtype(params))
    context = params.context
    masks.add_into(total, masks.expand(crypto.derive_key(seed, SELF_MASK, context), params), -1)
    for v in partners:
        if u in mask_keys:
            shared = crypto.agree(mask_keys[u], roster[v].mask_key, pairwise_purpose(u, v), context)
        else:
            shared = crypto.agree(mask_keys[v], roster[u].mask_key, pairwise_purpose(u, v), context)
        masks.add_into(total, masks.expand(shared, params), -pairwise_sign(u, v))
    return decode_signed(total.astype(np.uint64) & np.uint64(params.modulus_mask), params).astype(float)


# --- the search --------------------------------------------------------------------------------


def _subsets(items: list[int], rng: random.Random) -> frozenset[int]:
    return frozenset(i for i in items if rng.random() < 0.5)


def random_strategy(n: int, rng: random.Random) -> Strategy:
    """A strategy with a few deviations drawn at random (each kind with some probability)."""
    devices = list(range(n))
    pick = rng.random

    def per_device(make: Callable[[int], Any], chance: float) -> dict[int, Any]:
        return {d: make(d) for d in devices if pick() < chance}

    def others(d: int) -> list[int]:
        return [x for x in devices if x != d]

    return Strategy(
        hide_from_roster=per_device(lambda d: frozenset(rng.sample(others(d), 1)), 0.08),
        foreign_keys=per_device(lambda d: rng.choice(others(d)), 0.04),
        withhold=per_device(lambda d: _subsets(others(d), rng), 0.25),
        corrupt=per_device(lambda d: frozenset(rng.sample(others(d), 1)), 0.12),
        misroute=per_device(lambda d: tuple(rng.sample(others(d), 2)), 0.05),
        other_globals=frozenset(d for d in devices if pick() < 0.1),
        views=per_device(lambda d: frozenset({d} | _subsets(others(d), rng)), 0.5),
        hide_confirmations=per_device(lambda d: _subsets(devices, rng), 0.25),
        hide_statements=per_device(lambda d: _subsets(devices, rng), 0.1),
        misattribute=per_device(lambda d: tuple(rng.sample(devices, 2)), 0.05),
    )


def view_splits(n: int, target: int) -> list[Strategy]:
    """Every way of showing each device either the whole set of devices or the set without `target`
    as the survivors (the split that gets some to reveal its seed and others its mask key)."""
    everyone = frozenset(range(n))
    out = []
    for mask in range(1 << n):
        views = {d: everyone - {target} if mask >> d & 1 else everyone for d in range(n)}
        out.append(Strategy(views=views))
    return out


def mutate(strategy: Strategy, n: int, rng: random.Random) -> Strategy:
    """The strategy with one kind of deviation drawn again."""
    fresh = random_strategy(n, rng)
    name = rng.choice([f.name for f in dataclasses.fields(Strategy)])
    return dataclasses.replace(strategy, **{name: getattr(fresh, name)})


@dataclass
class SearchReport:
    strategies: int = 0
    exhaustive: int = 0
    random: int = 0
    guided: int = 0
    committed: int = 0  # rounds whose devices all reported (the honest sum came out)
    most_secrets: int = 0  # the most secrets of one device the server held in any round
    leaks: list[tuple[Strategy, Outcome]] = field(default_factory=list)


def search(
    n: int = 5,
    random_budget: int = 100,
    guided_budget: int = 50,
    seed: int = 0,
    threshold: float = 0.5,
    player: Callable[[Strategy, int, float, int], Outcome] = play,
) -> SearchReport:
    rng = random.Random(seed)
    report = SearchReport()

    def run(strategy: Strategy, kind: str) -> Outcome:
        outcome = player(strategy, n, threshold, rng.randrange(1 << 30))
        report.strategies += 1
        setattr(report, kind, getattr(report, kind) + 1)
        report.committed += outcome.committed
        report.most_secrets = max([report.most_secrets, *outcome.secrets.values()])
        if outcome.leaked:
            report.leaks.append((strategy, outcome))
        return outcome

    for target in range(n):
        for strategy in view_splits(n, target):
            run(strategy, "exhaustive")
    scored: list[tuple[int, Strategy]] = []
    for _ in range(random_budget):
        strategy = random_strategy(n, rng)
        outcome = run(strategy, "random")
        scored.append((max(outcome.secrets.values(), default=0), strategy))
    scored.sort(key=lambda pair: -pair[0])
    pool = [s for _, s in scored[:8]] or [Strategy()]
    for _ in range(guided_budget):
        parent = rng.choice(pool)
        child = mutate(parent, n, rng)
        outcome = run(child, "guided")
        if max(outcome.secrets.values(), default=0) >= report.most_secrets:
            pool.append(child)
    return report
