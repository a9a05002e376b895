"""The orchestrator's state: SQLAlchemy 2.0 typed models and the engine.

Everything a restarted server needs is here; nothing lives only in memory. Schema changes
are Alembic migrations (`orchestrator/migrations`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    Engine,
    ForeignKey,
    Index,
    LargeBinary,
    String,
    create_engine,
    event,
    false,
    select,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, column_property, mapped_column, sessionmaker
from sqlalchemy.pool import QueuePool


class Base(DeclarativeBase):
    pass


class Artifact(Base):
    """An exported `.tflite`, stored once by its sha256 and served as immutable."""

    __tablename__ = "artifacts"
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    content: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[float]


class Population(Base):
    """One model/task and the devices that train it."""

    __tablename__ = "populations"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    artifact_sha256: Mapped[str] = mapped_column(ForeignKey("artifacts.sha256"))
    # Deferred: read once per process (see rounds.population_settings), not with every row.
    manifest: Mapped[dict[str, Any]] = mapped_column(JSON, deferred=True)
    settings: Mapped[dict[str, Any]] = mapped_column(JSON, deferred=True)
    current_version: Mapped[int] = mapped_column(default=0)
    training_rounds_committed: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[float]
    # Training rounds in a row that closed without a check-in, and while backing off from opening
    # the next (idle_backoff), when it may open without one.
    idle_rounds: Mapped[int] = mapped_column(default=0)
    next_round_at: Mapped[float | None] = mapped_column(default=None)
    paused_at: Mapped[float | None] = mapped_column(default=None)  # paused: no new rounds (pausing)
    settings_version: Mapped[int] = mapped_column(default=0)  # moved by each settings change
    archived_at: Mapped[float | None] = mapped_column(default=None)  # archived: paused for good


class SettingsChange(Base):
    """A change of a population's settings (settings_changes): its version, what changed from
    what, who made it and when."""

    __tablename__ = "settings_changes"
    population_id: Mapped[int] = mapped_column(ForeignKey("populations.id"), primary_key=True)
    version: Mapped[int] = mapped_column(primary_key=True)
    changes: Mapped[dict[str, Any]] = mapped_column(JSON)
    previous: Mapped[dict[str, Any]] = mapped_column(JSON)
    changed_by: Mapped[str] = mapped_column(String(200))
    changed_at: Mapped[float]


class ModelVersion(Base):
    """The global parameters after a committed round (version 0: the export's initial values)."""

    __tablename__ = "model_versions"
    population_id: Mapped[int] = mapped_column(ForeignKey("populations.id"), primary_key=True)
    version: Mapped[int] = mapped_column(primary_key=True)
    params: Mapped[bytes] = mapped_column(LargeBinary)  # safetensors, dense
    optimizer_state: Mapped[bytes] = mapped_column(LargeBinary)  # safetensors
    round_id: Mapped[int | None]
    created_at: Mapped[float]


class CentralizedData(Base):
    """A population's centralized (public, server-side) dataset and the strategy that mixes it
    into federated training (contracts.mixing); at most one per population, replaced on attach."""

    __tablename__ = "centralized_data"
    population_id: Mapped[int] = mapped_column(ForeignKey("populations.id"), primary_key=True)
    mixing: Mapped[dict[str, Any]] = mapped_column(JSON)  # MixingConfig
    # Deferred: a check-in needs the strategy, not the examples.
    examples: Mapped[bytes] = mapped_column(
        LargeBinary, deferred=True
    )  # safetensors, the manifest's features
    num_examples: Mapped[int]
    sha256: Mapped[str] = mapped_column(String(64))  # of `examples`: keys the decoded cache
    attached_at: Mapped[float]


class Device(Base):
    __tablename__ = "devices"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64))  # sha256 of the secret; the secret is never stored
    created_at: Mapped[float]


class DashboardSession(Base):
    """A signed-in operator's dashboard session (orchestrator/dashboard/sessions.py). The cookie
    holds a random secret; only its sha256 is kept, so a copy of the database opens no session."""

    __tablename__ = "dashboard_sessions"
    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[float]
    expires_at: Mapped[float]
    address: Mapped[str] = mapped_column(String(100))  # the signing-in client's, for the log


class RoundAdmission(Base):
    """A round's check-in counters, on their own row: a check-in's admission locks this row, a
    report's count the round's, so neither waits for the other (`round_admissions`). A round
    reads them as its own (`Round.checked_in`, ...)."""

    __tablename__ = "round_admissions"
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"), primary_key=True)
    checked_in: Mapped[int] = mapped_column(default=0)
    accepted: Mapped[int] = mapped_column(default=0)
    rejected_capacity: Mapped[int] = mapped_column(default=0)
    rejected_min_examples: Mapped[int] = mapped_column(default=0)


def _admission(name: str, round_id: Any) -> Any:
    """A round's admission counter, read with the round; read-only there (written by one statement
    on the admission row: `rounds.checkin`)."""
    column = getattr(RoundAdmission, name)
    return column_property(select(column).where(RoundAdmission.round_id == round_id).scalar_subquery())


class Round(Base):
    """A training or evaluation round; its counters are the participation funnel."""

    __tablename__ = "rounds"
    id: Mapped[int] = mapped_column(primary_key=True)
    population_id: Mapped[int] = mapped_column(ForeignKey("populations.id"))
    kind: Mapped[str] = mapped_column(String(16))  # training | evaluation | cohort (cohorts)
    status: Mapped[str] = mapped_column(String(16))  # open | committed | abandoned
    base_version: Mapped[int]
    result_version: Mapped[int | None]
    target: Mapped[int]
    capacity: Mapped[int]
    min_reports: Mapped[int]
    opened_at: Mapped[float]
    deadline: Mapped[float]
    closed_at: Mapped[float | None]
    # Pace steering: a device turned away as the round is full comes back within this many seconds.
    checkin_window: Mapped[float | None] = mapped_column(default=None)
    checked_in: Mapped[int] = _admission("checked_in", id)
    accepted: Mapped[int] = _admission("accepted", id)
    rejected_capacity: Mapped[int] = _admission("rejected_capacity", id)
    rejected_min_examples: Mapped[int] = _admission("rejected_min_examples", id)
    reported: Mapped[int] = mapped_column(default=0)
    dropped: Mapped[int] = mapped_column(default=0)
    late: Mapped[int] = mapped_column(default=0)
    invalid: Mapped[int] = mapped_column(default=0)
    aborted: Mapped[int] = mapped_column(default=0)
    total_weight: Mapped[float] = mapped_column(default=0.0)
    metrics: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)  # sums over reports
    # A committed training round: per global tensor, the reference L2 norm that the next round
    # clips deltas to a multiple of, with the recent rounds' history (norm_reference.NormReference).
    norm_reference: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), default=None)
    # Why it closed (round_state.Closing): the sentence, and for a round that did not commit the
    # phase it stopped in, the devices it had and needed there, and what ended it.
    close_reason: Mapped[str] = mapped_column(String(500), default="")
    stopped_phase: Mapped[str | None] = mapped_column(String(16), default=None)
    devices_had: Mapped[int | None] = mapped_column(default=None)
    devices_needed: Mapped[int | None] = mapped_column(default=None)
    ended_by: Mapped[str | None] = mapped_column(String(16), default=None)

    __table_args__ = (Index("rounds_open", "population_id", "kind", "status"),)


class Assignment(Base):
    """A device's place in a round, from check-in to report, abort or drop."""

    __tablename__ = "assignments"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"))
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id"), index=True)
    status: Mapped[str] = mapped_column(String(16))  # assigned | reported | aborted | dropped | invalid
    example_count: Mapped[int]
    created_at: Mapped[float]
    deadline: Mapped[float]
    finished_at: Mapped[float | None]

    # One assignment per device per round, enforced by the database as well as by the state
    # machine (several server processes may share one PostgreSQL); it is also the index that
    # the check-in's "has this device taken part?" lookup needs, whatever the round's size.
    __table_args__ = (Index("assignments_round_device", "round_id", "device_id", unique=True),)


class Report(Base):
    """An accepted report: its weight, metrics and (training) its delta, stored sparse."""

    __tablename__ = "reports"
    assignment_id: Mapped[str] = mapped_column(ForeignKey("assignments.id"), primary_key=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"), index=True)
    weight: Mapped[float]
    delta: Mapped[bytes | None] = mapped_column(LargeBinary)
    metrics: Mapped[dict[str, float]] = mapped_column(JSON)


class SecureRound(Base):
    """A training round under secure aggregation: its phase and the parameters devices agree on."""

    __tablename__ = "secure_rounds"
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"), primary_key=True)
    # advertise | share_keys | masked_input | consistency | unmasking | done
    phase: Mapped[str] = mapped_column(String(16))
    phase_deadline: Mapped[float]
    parameters: Mapped[dict[str, Any]] = mapped_column(JSON)  # secure_aggregation RoundParameters
    outcome: Mapped[str] = mapped_column(String(500), default="")  # why it was abandoned, or ""
    # The phases' counters (secure_round_state): devices that reached each stage, and that left
    # at each stage; each event moves them in one statement (round_counts.count_secure).
    advertised: Mapped[int] = mapped_column(default=0, server_default="0")
    sharers: Mapped[int] = mapped_column(default=0, server_default="0")
    senders: Mapped[int] = mapped_column(default=0, server_default="0")
    signers: Mapped[int] = mapped_column(default=0, server_default="0")
    responders: Mapped[int] = mapped_column(default=0, server_default="0")
    left_before_keys: Mapped[int] = mapped_column(default=0, server_default="0")
    left_before_shares: Mapped[int] = mapped_column(default=0, server_default="0")
    left_before_input: Mapped[int] = mapped_column(default=0, server_default="0")
    left_before_confirmation: Mapped[int] = mapped_column(default=0, server_default="0")


class SecureParticipant(Base):
    """One assignment's messages in a secure round. Its masked input is kept only until the round
    closes; the server never holds an unmasked individual update."""

    __tablename__ = "secure_participants"
    assignment_id: Mapped[str] = mapped_column(ForeignKey("assignments.id"), primary_key=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"))
    device_index: Mapped[int]  # its index in the round's roster (a Shamir x coordinate), from 1
    keys: Mapped[dict[str, str]] = mapped_column(JSON)
    # The messages are deferred, and flags say which were sent: the phases read every participant's
    # row on every request, while shares are ~6 KB and an input ~0.75 MB (3,706 x 50, 20 neighbours).
    shares: Mapped[dict[str, Any] | None] = mapped_column(JSON, deferred=True)
    sent_shares: Mapped[bool] = mapped_column(default=False)
    sent_masked_input: Mapped[bool] = mapped_column(default=False)  # the input: SecureMaskedInput
    # Its partner statement (secure_aggregation.view), sent before its masked input: the inputs it
    # trained on and the neighbours it masked nothing with.
    partners: Mapped[dict[str, Any] | None] = mapped_column(JSON, deferred=True, nullable=True)
    # The consistency check: its signed confirmation of the survivor set; confirmed: it is a
    # survivor (chosen when the masked-input phase closes), its input is in the sum unmasked.
    consistency: Mapped[dict[str, Any] | None] = mapped_column(JSON, deferred=True)
    sent_consistency: Mapped[bool] = mapped_column(default=False, server_default=false())
    confirmed: Mapped[bool] = mapped_column(default=False, server_default=false())
    unmasking: Mapped[dict[str, Any] | None] = mapped_column(JSON, deferred=True)
    sent_unmasking: Mapped[bool] = mapped_column(default=False)

    __table_args__ = (
        Index("secure_participants_round_index", "round_id", "device_index", unique=True),
        # A phase's close lists the participants' flags (and drops by them): in SQLite a row's
        # flags come after its shares (~9 KB at 60 neighbours, in overflow pages), so they are read
        # from this covering index instead (migration 0015).
        Index(
            "secure_participants_flags",
            "round_id",
            "assignment_id",
            "device_index",
            "sent_shares",
            "sent_masked_input",
            "sent_consistency",
            "confirmed",
            "sent_unmasking",
        ),
    )


class SecureMaskedInput(Base):
    """A participant's masked input (~0.75 MB), kept only until its round closes. A table of its
    own: in SQLite a row's columns after a large value are read through its overflow pages, so
    every read of a participant's flags walked the whole input."""

    __tablename__ = "secure_masked_inputs"
    assignment_id: Mapped[str] = mapped_column(ForeignKey("assignments.id"), primary_key=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"), index=True)
    masked_input: Mapped[bytes] = mapped_column(LargeBinary)


class CohortSum(Base):
    """A buffered secure population's cohort, unmasked: the sum of its survivors' clipped deltas,
    held by the buffer it went into until that buffer closes (cohort_sums). Never one device's
    update: a cohort's sum holds at least its min_reports (>= 3) inputs."""

    __tablename__ = "cohort_sums"
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"), primary_key=True)  # the cohort
    buffer_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"), index=True)
    members: Mapped[int]  # the survivors whose inputs the sum holds
    staleness: Mapped[int]  # versions committed between the cohort's download and its entry
    factor: Mapped[float]  # f(staleness): the whole sum's weight is members x factor
    total: Mapped[bytes] = mapped_column(LargeBinary)  # the sum, dense float32 safetensors


class SecureRoundKey(Base):
    """A key advertised in a secure round, unique within it: an indexed lookup refuses a device
    that repeats another's key (kind "agreement": its X25519 keys and self-mask commitment;
    "device": its certified signing key), where comparing with every earlier advertisement made
    a round's advertisements O(n^2)."""

    __tablename__ = "secure_round_keys"
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    key: Mapped[bytes] = mapped_column(LargeBinary(64), primary_key=True)


def make_engine(url: str, busy_seconds: float = 30.0) -> Engine:
    """An engine whose write transactions serialize cleanly on SQLite as on PostgreSQL.

    `busy_seconds` bounds how long SQLite waits for another connection's lock (and for this
    engine's one pooled connection). The server passes 0: its SQLite work runs on the event
    loop, where a wait would stall every request, so it retries asynchronously instead
    (api/deps.py: run_db). Command-line tools keep the patient default."""
    if url.startswith("sqlite"):
        # One connection, shared in turn: SQLite has one writer anyway, and threads queued on
        # the pool are handed the connection at once, where threads racing for the write lock
        # sleep in SQLite's busy handler (1, 2, 5, 10... ms), which cut throughput tenfold.
        engine = create_engine(
            url,
            hide_parameters=True,  # an error's message must not quote tokens' hashes or deltas (logs)
            connect_args={"check_same_thread": False, "timeout": busy_seconds},
            poolclass=QueuePool,
            pool_size=1,
            max_overflow=0,
            pool_timeout=max(busy_seconds, 1.0),
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            # Let SQLAlchemy, not the driver, decide when a transaction starts.
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            # WAL with synchronous=NORMAL: a commit is in the WAL file (the OS's page cache) before
            # it returns, so a killed server process (the crash test's SIGKILL) loses nothing it
            # answered; only a power cut or kernel crash can lose the last commits (never corrupt).
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute("PRAGMA foreign_keys = ON")
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_seconds * 1000)}")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _begin_immediate(conn: Any) -> None:
            # Take the write lock up front: a read that later writes would otherwise
            # deadlock against another writer and fail with "database is locked".
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True, hide_parameters=True)


def sessions_that_keep_what_they_load(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay in their identity map for the whole transaction.

    SQLAlchemy's identity map holds objects weakly: an object that no caller holds any more is
    collected, and the next `session.get` of it in the same transaction reads it again. A secure
    round's message read its round's row four times so (to check the deadline, in the handler, to
    advance the round, for the answer's state), and each check-in of a group read it again: a
    fifth of the server's time in the secure main job went to those reads. Transactions here are
    short and load few objects (bulk reads select columns), so holding them costs little memory.
    (SQLAlchemy's documented recipe, "Session Referencing Behavior".)"""
    factory = sessionmaker(engine, expire_on_commit=False)

    @event.listens_for(factory, "loaded_as_persistent")
    @event.listens_for(factory, "pending_to_persistent")
    @event.listens_for(factory, "detached_to_persistent")
    def _hold(session: Session, instance: object) -> None:
        session.info.setdefault(_HELD, set()).add(instance)

    @event.listens_for(factory, "persistent_to_detached")
    @event.listens_for(factory, "persistent_to_deleted")
    @event.listens_for(factory, "persistent_to_transient")
    def _release(session: Session, instance: object) -> None:
        session.info.get(_HELD, set()).discard(instance)

    return factory


_HELD = "objects held for the transaction"
