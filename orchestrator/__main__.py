"""`python -m orchestrator`: serve, create a population, show status (against the database), and
the operator's console (against a running server's admin API: `orchestrator.console`)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from contracts.command_line import CommandParser, quiet_on_closed_pipe
from orchestrator.console import cli as console
from orchestrator.settings import Settings, server_settings_problem


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(
        prog="orchestrator",
        description="The federated-learning server (also `python -m orchestrator`): serve its HTTP API, "
        "create populations from exported models, attach centralized data, show a population's state.",
    )
    parser.add_argument(
        "--database-url", help="default: $ORCHESTRATOR_DATABASE_URL or sqlite:///orchestrator.sqlite"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP server")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--forwarded-allow-ips",
        help="proxies whose X-Forwarded-For is believed, comma-separated addresses or networks "
        "(default: $ORCHESTRATOR_FORWARDED_ALLOW_IPS, or none)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="server processes sharing the port (PostgreSQL only; default 1)",
    )
    create = sub.add_parser("create-population", help="create a population from an exported model directory")
    create.add_argument("name")
    create.add_argument("--model-dir", type=Path, required=True, help="output of `python -m model_export`")
    create.add_argument("--settings", default="{}", help="PopulationSettings as JSON (or @file.json)")
    create.add_argument(
        "--initial-globals",
        type=Path,
        metavar="FILE",
        help="version 0's global parameters (safetensors, e.g. android_sim simulate's "
        "global_params.safetensors) instead of the export's",
    )
    mix = sub.add_parser(
        "mix", help="attach a mixing strategy and centralized examples to a population (contracts.mixing)"
    )
    mix.add_argument("name")
    mix.add_argument(
        "--mixing",
        required=True,
        help='MixingConfig as JSON (or @file.json), e.g. {"strategy": "parallel_training", "weight": 0.3}',
    )
    mix.add_argument(
        "--examples",
        type=Path,
        help=(
            'centralized examples (safetensors, one tensor per feature; optionally "@group": int64 ids '
            "saying which examples belong together, e.g. each one's public account); omit to keep"
        ),
    )
    status = sub.add_parser("status", help="print a population's state and latest rounds as JSON")
    status.add_argument("name")
    console.add_commands(sub)
    args = parser.parse_args(argv)
    if args.command in console.BY_NAME:
        return console.run(args)

    overrides = {k: v for k, v in (("database_url", args.database_url),) if v}
    if args.command == "serve":
        given = (("host", args.host), ("port", args.port), ("forwarded_allow_ips", args.forwarded_allow_ips))
        overrides.update({k: v for k, v in given if v is not None})
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        print(f"error: {server_settings_problem(e)}", file=sys.stderr)
        return 2

    if args.command == "serve":
        from orchestrator.serve import serve as run_server

        return run_server(settings, args.workers)

    from orchestrator.db import Population, make_engine
    from orchestrator.migrate import DatabaseUnusable, migrate
    from orchestrator.service.population_creation import ExportedModel, PopulationError, create_population

    population_settings: Any = None
    if args.command == "create-population":
        # Read before the database is touched: a bad settings file changes nothing.
        try:
            population_settings = _settings_json(args.settings)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        migrate(settings.database_url)
    except DatabaseUnusable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = make_engine(settings.database_url)
    if args.command == "create-population":
        try:
            with Session(engine) as session, session.begin():
                population = create_population(
                    session,
                    args.name,
                    ExportedModel.from_dir(args.model_dir, args.initial_globals),
                    population_settings,
                    time.time(),
                )
                sha = population.artifact_sha256[:12]
                print(f"created population {population.name!r} (model {sha}..., version 0)")
        except PopulationError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "mix":
        return _mix(engine, args.name, args.mixing, args.examples)
    from orchestrator.service.population_views import population_out

    with Session(engine) as session:
        found = session.scalars(select(Population).where(Population.name == args.name)).first()
        if found is None:
            print(f"error: no population {args.name!r}", file=sys.stderr)
            return 2
        print(json.dumps(dataclasses.asdict(population_out(session, found)), indent=2))
    return 0


def _settings_json(raw: str) -> Any:
    """`--settings` as JSON: the text itself, or `@file.json` for a file's; one line when it is neither."""
    if raw.startswith("@"):
        path = Path(raw[1:])
        try:
            raw = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(
                f"--settings {raw}: cannot read {path}: {reason} (expected a JSON file)"
            ) from None
        where = str(path)
    else:
        where = "--settings"
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from None


def _mix(engine: Any, name: str, raw: str, examples: Path | None) -> int:
    from contracts.mixing import MAX_CENTRAL_BYTES, MixingError
    from orchestrator.populations import mixing
    from orchestrator.populations.config import population_manifest
    from orchestrator.populations.locks import lock_population

    try:
        config = json.loads(Path(raw[1:]).read_text() if raw.startswith("@") else raw)
        blob = None
        if examples is not None:
            size = examples.stat().st_size
            if size > MAX_CENTRAL_BYTES:
                raise MixingError(f"{examples} is {size} bytes; the limit is {MAX_CENTRAL_BYTES}")
            blob = examples.read_bytes()
        with Session(engine) as session, session.begin():
            population = lock_population(session, name)
            if population is None:
                raise MixingError(f"no population {name!r}")
            mixing.attach(session, population, population_manifest(population), config, blob, time.time())
            print(json.dumps(mixing.describe(session, population)))
    except (MixingError, json.JSONDecodeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
