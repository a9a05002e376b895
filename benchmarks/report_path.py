"""How far one report travels: the path from the report route to the new model version.

    python -m benchmarks.report_path [--model-dir DIR] [--show]

Sets up a real SQLite population whose rounds commit at one report, commits one round, then
traces (sys.setprofile) the transaction the report route hands the next report to
(`report_transaction` in orchestrator/service/reports.py; `_report` in the routes before, which
this tool also finds, so that older commits are measured the same way) from its start to the new
model version: its validation, storage, the round's commit and the aggregation, up to the moment
the new `ModelVersion` is made (what the commit does after it, such as opening the next round or
pruning old versions, and the answer to the device are not on the path to it). Prints:
- stops: the distinct project functions it enters (orchestrator, contracts, secure_aggregation,
  model_runtime), in the order first entered. Only the report's own calls: a function that a
  library calls back (SQLAlchemy's transaction event hooks) is not a stop; comprehensions,
  lambdas and generated methods (a dataclass's `__init__`) are not stops themselves, but what they
  call is;
- module visits: how often that sequence of stops moves into another module than the last;
- modules: the distinct modules of those stops, and how many stops each holds;
- climbs: how often the next stop lies on a higher floor than the one before, where a module's
  floor is 1 + the highest floor among the project modules it imports (contracts' leaves are 0):
  each climb is control going back up the layers to be sent down again;
- hops: the stops entered by a call from another module (the traced block counts as one), with
  the aggregation pipeline (the stages of orchestrator/aggregation, the maths they run and the
  server optimizer: `PIPELINE`) as one part, since the commit hands it a round in one call; a
  module's own helpers and the stages' calls among themselves are inside the hop that entered
  them. And the climbs among the hops, counted as for stops;
- calls back up: the distinct calls on the path from a project function into one on a higher
  floor than its own (a callback, or a generator of a higher module that a lower one pulls from;
  comprehensions and lambdas count here, as the code they run in): the only way control can
  climb back up without returning first, since no module imports one above it;
- SQL statements: how many the transaction of a report that is only counted runs (most reports:
  here the first of a round of two), and of the report that commits the round (the second), with
  how many of those run before the new `ModelVersion` is made; --show lists them.
The first run exports a small model with TensorFlow (about a minute); --model-dir reuses one.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from contracts.manifest import Manifest
from contracts.params import encode_sparse_delta
from model_export.config import ModelConfig
from model_export.in_subprocess import export_in_subprocess
from orchestrator.db import make_engine
from orchestrator.devices import enroll
from orchestrator.migrate import migrate
from orchestrator.populations.locks import lock_population
from orchestrator.rounds import checkins
from orchestrator.rounds.refusals import Refused
from orchestrator.service.population_creation import ExportedModel, PopulationError, create_population

ROOT = Path(__file__).resolve().parent.parent

PACKAGES = ("orchestrator", "contracts", "secure_aggregation", "model_runtime")
MODEL = ModelConfig(num_items=200, embedding_dim=4, batch_size=5, max_batches=4)


def module_of(path: Path) -> str | None:
    """The dotted name of a project source file, None outside the project's packages."""
    try:
        parts = path.resolve().relative_to(ROOT).with_suffix("").parts
    except ValueError:
        return None
    if not parts or parts[0] not in PACKAGES:
        return None
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(module: str) -> set[str]:
    """The project modules `module` imports (at any place in its source)."""
    base = ROOT.joinpath(*module.split("."))
    source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    found: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if name.split(".")[0] in PACKAGES and name != module and _exists(name):
                found.add(name)
    return found


def _exists(module: str) -> bool:
    base = ROOT.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def floors() -> dict[str, int]:
    """Each project module's floor: 1 + the highest floor of the project modules it imports."""
    modules = [module_of(p) for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    graph = {m: project_imports(m) for m in modules if m is not None}
    floor: dict[str, int] = {}

    def of(module: str, seen: frozenset[str]) -> int:
        if module not in floor:
            below = [of(m, seen | {module}) for m in graph.get(module, ()) if m not in seen]
            floor[module] = 1 + max(below) if below else 0
        return floor[module]

    for module in graph:
        of(module, frozenset())
    return floor


@dataclass(frozen=True)
class Stop:
    module: str
    function: str


GENERATED = "<generated>"  # code with no source file (a dataclass's __init__)


# The aggregation pipeline as one part: its stages and the maths they run, and the server step. The
# round's commit hands it the round's contributions in one call (`Pipeline.aggregate`) and gets the
# mean delta back, so what its stages call among themselves is inside that one hop.
PIPELINE = tuple(
    f"orchestrator.aggregation.{name}"
    for name in (
        "pipeline",
        "assemble",
        "registry",
        "robust",
        "weighted_mean",
        "coordinate_wise",
        "private",
        "secure_sum",
        "central_merge",
        "tensor_shapes",
        "server_optimizer",
    )
)


def part_of(module: str) -> str:
    """The part a module belongs to for hops: the pipeline's modules are one, any other its own."""
    for prefix in PIPELINE:
        if module == prefix or module.startswith(prefix + "."):
            return PIPELINE[0]
    return module


@dataclass
class Trace:
    stops: list[Stop]  # every project function entered, in the order first entered
    hops: list[Stop]  # those entered by a call from another part (see `part_of`)
    up: list[tuple[Stop, Stop]]  # calls from a project function into a higher floor's (caller, callee)


@contextmanager
def traced() -> Iterator[Trace]:
    """The stops of the calls made inside the block, until the new model version is made."""
    from sqlalchemy import event

    from orchestrator.db import ModelVersion

    stops: list[Stop] = []
    seen: set[Stop] = set()
    hops: list[Stop] = []
    seen_hops: set[Stop] = set()
    up: list[tuple[Stop, Stop]] = []
    floor = floors()
    modules: dict[str, str | None] = {}
    arrived = False

    def module(frame: FrameType) -> str | None:
        filename = frame.f_code.co_filename
        if filename not in modules:
            modules[filename] = GENERATED if filename.startswith("<") else module_of(Path(filename))
        return modules[filename]

    def called_by_project(frame: FrameType) -> bool:
        """Whether the nearest caller that is not a comprehension, lambda or generated method is
        a project function (or the traced block itself): not a library calling back."""
        caller = frame.f_back
        while caller is not None and (module(caller) == GENERATED or caller.f_code.co_name.startswith("<")):
            caller = caller.f_back
        return caller is None or caller.f_code is block or module(caller) is not None

    def version_made(*_: object) -> None:
        nonlocal arrived
        arrived = True

    def profile(frame: FrameType, event_name: str, _: Any) -> None:
        if event_name != "call" or arrived:
            return
        code = frame.f_code
        name = module(frame)
        if name is None or name == GENERATED:
            return
        calling = caller_of(frame)
        if calling is not None and floor[name] > floor[calling[0]]:
            call = (Stop(*calling), Stop(name, code.co_qualname))
            if call not in up:
                up.append(call)
        if code.co_name.startswith("<"):
            return
        if not called_by_project(frame):
            return
        stop = Stop(name, code.co_qualname)
        if stop not in seen:
            seen.add(stop)
            stops.append(stop)
        if stop not in seen_hops and crosses(frame, name):
            seen_hops.add(stop)
            hops.append(stop)

    def nearest_caller(frame: FrameType) -> FrameType | None:
        """The frame that made this call, past generated methods (they have no source to stop in)."""
        caller = frame.f_back
        while caller is not None and module(caller) == GENERATED:
            caller = caller.f_back
        return caller

    def caller_of(frame: FrameType) -> tuple[str, str] | None:
        """The project function (module, name) that made this call, None if not one (a library,
        or the traced block)."""
        caller = nearest_caller(frame)
        if caller is None or caller.f_code is block:
            return None
        calling = module(caller)
        return None if calling is None else (calling, caller.f_code.co_qualname)

    def crosses(frame: FrameType, name: str) -> bool:
        """Whether the call comes from another part (the traced block counts as one); a
        comprehension or lambda calls from the module its source is in."""
        caller = nearest_caller(frame)
        if caller is None or caller.f_code is block:
            return True
        calling = module(caller)
        return calling is None or part_of(calling) != part_of(name)

    block = sys._getframe(2).f_code  # the function whose `with traced()` block is traced
    event.listen(ModelVersion, "init", version_made)
    sys.setprofile(profile)
    try:
        yield Trace(stops, hops, up)
    finally:
        sys.setprofile(None)
        event.remove(ModelVersion, "init", version_made)
        if not arrived:
            raise AssertionError("the traced report made no new model version")


def entry() -> tuple[Any, Any]:
    """The function the report route hands a report to, and its call's type: the service layer's
    since it exists, the route module's own `_report` before (to measure older commits alike)."""
    try:
        from orchestrator.service.reports import ReportCall, report_transaction
    except ImportError:
        from orchestrator.api.routes import assignments

        return assignments._report, assignments._ReportCall  # type: ignore[attr-defined]
    return report_transaction, ReportCall


@dataclass
class Statements:
    run: list[str]  # the SQL statements run, in order
    to_version: int | None = None  # how many had run when the new model version was made


@contextmanager
def statements(engine: Any) -> Iterator[Statements]:
    """The SQL statements run on `engine` inside the block (SQLite's BEGIN IMMEDIATE included: it
    is a round trip), and how many before a new model version is made."""
    from sqlalchemy import event

    from orchestrator.db import ModelVersion

    found = Statements([])

    def executed(_conn: Any, _cursor: Any, statement: str, *_: object) -> None:
        found.run.append(" ".join(statement.split()))

    def version_made(*_: object) -> None:
        found.to_version = len(found.run)

    event.listen(engine, "before_cursor_execute", executed)
    event.listen(ModelVersion, "init", version_made)
    try:
        yield found
    finally:
        event.remove(engine, "before_cursor_execute", executed)
        event.remove(ModelVersion, "init", version_made)


@dataclass
class Measured:
    trace: Trace
    committing: Statements  # the SQL statements of the transaction of a report that commits
    counting: Statements  # those of a report that is only counted (most reports)


def one_report(model_dir: Path, database: Path) -> Measured:
    """The stops of a report that commits a round, on a SQLite population that has committed one
    round already (so that what is parsed or learnt once per population is not counted), and the
    SQL statements of that report's transaction and of the report before it, which is only
    counted (rounds of two reports)."""
    from sqlalchemy.orm import sessionmaker

    transaction, call_type = entry()
    url = f"sqlite:///{database}"
    migrate(url)
    engine = make_engine(url)
    factory = sessionmaker(engine, expire_on_commit=False)
    model = ExportedModel.from_dir(model_dir)
    manifest = Manifest.from_json(model.manifest)
    with factory.begin() as session:
        create_population(session, "p", model, {"target_reports": 2}, 0.0)
    measured: list[Measured] = []
    for now in (1.0, 3.0):  # the first round warms up, the second is measured
        calls = []
        for _ in range(2):
            with factory.begin() as session:
                device_id, token = enroll(session, now)
                population = lock_population(session, "p")
                assert population is not None
                (accepted,) = checkins.checkin(
                    session, population, [checkins.CheckIn(device_id, 20, "training")], now
                )
            assert isinstance(accepted, checkins.Accepted), accepted
            delta = {s.name: np.zeros(s.shape, np.float32) for s in manifest.global_params}
            for array in delta.values():
                array.reshape(-1)[:2] = 0.01
            metadata = {"num_examples": "10", "metrics": json.dumps({"update_loss": 0.5})}
            body = encode_sparse_delta(delta, metadata)
            calls.append(call_type(accepted.assignment_id, token, body, "application/octet-stream"))
        with statements(engine) as counting:
            (answer,) = transaction(factory, calls[:1], now + 1.0)
        assert not isinstance(answer, Refused), answer.message
        assert answer.round_status == "open", answer
        with statements(engine) as committing, traced() as trace:
            (answer,) = transaction(factory, calls[1:], now + 1.0)
        assert not isinstance(answer, Refused), answer.message
        assert answer.round_status == "committed", answer
        measured.append(Measured(trace, committing, counting))
    return measured[-1]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.report_path",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model-dir", type=Path, help="an exported model (default: export a small one)")
    parser.add_argument("--show", action="store_true", help="print every stop with its floor")
    args = parser.parse_args()
    if args.model_dir is not None:
        try:
            ExportedModel.from_dir(args.model_dir)
        except PopulationError as e:
            parser.error(f"--model-dir: {e} (expected the output of `python -m model_export`)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or export_in_subprocess(MODEL, Path(tmp) / "model")
        measured = one_report(model_dir, Path(tmp) / "orchestrator.sqlite")
    stops, hops, floor = measured.trace.stops, measured.trace.hops, floors()
    climbs = sum(1 for a, b in itertools.pairwise(stops) if floor[b.module] > floor[a.module])
    hop_climbs = sum(1 for a, b in itertools.pairwise(hops) if floor[b.module] > floor[a.module])
    if args.show:
        for stop in stops:
            hop = "hop" if stop in hops else ""
            print(f"  {floor[stop.module]:2d} {hop:3s}  {stop.module}.{stop.function}")
    per_module = Counter(stop.module for stop in stops)
    visits = 1 + sum(1 for a, b in itertools.pairwise(stops) if a.module != b.module)
    print(f"stops: {len(stops)}  module visits: {visits}  modules: {len(per_module)}  climbs: {climbs}")
    for module, count in per_module.most_common():
        print(f"  {count:3d}  {module} (floor {floor[module]})")
    print(
        f"hops: {len(hops)}  climbs among them: {hop_climbs}  (the stops entered from another part; "
        "the pipeline's modules are one part)"
    )
    print(
        f"SQL statements: {len(measured.counting.run)} for a report that is counted, "
        f"{len(measured.committing.run)} for one that commits its round "
        f"({measured.committing.to_version} of them before the new version is made)"
    )
    print(f"calls back up a floor: {len(measured.trace.up)}")
    for caller, callee in measured.trace.up:
        print(f"  {caller.module}.{caller.function} -> {callee.module}.{callee.function}")
    if args.show:
        for name, run in (("counted", measured.counting), ("commits", measured.committing)):
            for statement in run.run:
                print(f"  {name}: {statement[:120]}")


if __name__ == "__main__":
    main()
