"""The operator's side of the orchestrator's admin API: create or reuse a population, watch rounds.
It calls the routes as `orchestrator.console.commands` declares them, as the console does."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx

from contracts.manifest import INITIAL_GLOBAL_FILE, MANIFEST_FILE, MODEL_FILE
from orchestrator.console.routes import (
    ATTACH_MIXING,
    CHANGE_SETTINGS,
    CREATE,
    EVALUATE,
    POPULATION,
    POPULATIONS,
    ROUNDS,
    AdminRoute,
)


class AdminError(RuntimeError):
    """The orchestrator is unreachable or refused an admin request; the message says which."""


class AdminClient:
    def __init__(
        self, base_url: str, admin_token: str, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(transport=transport, timeout=60.0)
        self._headers = {"Authorization": f"Bearer {admin_token}"}

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, route: AdminRoute, name: str | None = None, **kwargs: Any) -> Any:
        """The JSON answer of `route` (of population `name` if its path has one)."""
        method, path = route.method, route.url() if name is None else route.url(name=name)
        try:
            response = await self._http.request(
                method, f"{self.base_url}{path}", headers=self._headers, **kwargs
            )
        except httpx.TransportError as e:
            raise AdminError(
                f"no orchestrator answers at {self.base_url} ({type(e).__name__}: {e})"
            ) from None
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except (json.JSONDecodeError, AttributeError):
                detail = response.text[:300]
            raise AdminError(f"{method} {path}: {response.status_code}: {detail}")
        return response.json()

    async def ping(self) -> None:
        """Raises AdminError unless an orchestrator answers and accepts the admin token."""
        await self._request(POPULATIONS)

    async def ensure_population(
        self, name: str, model_dir: Path, settings: dict[str, Any], initial_globals: bytes | None = None
    ) -> dict[str, Any]:
        """The population `name`: created from `model_dir` if new (starting from `initial_globals`,
        default the export's); reused if it serves the same model."""
        sha = hashlib.sha256((model_dir / MODEL_FILE).read_bytes()).hexdigest()
        existing = {p["name"]: p for p in await self._request(POPULATIONS)}
        if name in existing:
            found: dict[str, Any] = existing[name]
            if found["artifact_sha256"] != sha:
                raise AdminError(
                    f"population {name!r} exists with model {found['artifact_sha256'][:12]}..., not this "
                    f"export's {sha[:12]}...; choose another --population name"
                )
            return found
        files = {
            "model": (MODEL_FILE, (model_dir / MODEL_FILE).read_bytes()),
            "manifest": (MANIFEST_FILE, (model_dir / MANIFEST_FILE).read_bytes()),
            "global_params": (
                INITIAL_GLOBAL_FILE,
                initial_globals
                if initial_globals is not None
                else (model_dir / INITIAL_GLOBAL_FILE).read_bytes(),
            ),
        }
        created: dict[str, Any] = await self._request(
            CREATE,
            data={"name": name, "settings": json.dumps(settings)},
            files=files,
        )
        return created

    async def status(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._request(POPULATION, name)
        return result

    async def rounds(
        self, name: str, kind: str | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """Rounds, oldest first: the newest `limit` of them, or all (fetched a page at a time)."""
        found: list[dict[str, Any]] = []
        page = 1000 if limit is None else min(limit, 1000)
        while True:
            params: dict[str, Any] = {"limit": page, "offset": len(found)}
            if kind:
                params["kind"] = kind
            batch: list[dict[str, Any]] = await self._request(ROUNDS, name, params=params)
            found.extend(batch)
            if len(batch) < page or (limit is not None and len(found) >= limit):
                break
        return sorted(found, key=lambda r: int(r["id"]))

    async def change_settings(self, name: str, settings: dict[str, Any], operator: str) -> dict[str, Any]:
        """Change settings that are safe to change while rounds run (from the next round on)."""
        result: dict[str, Any] = await self._request(
            CHANGE_SETTINGS, name, json={"settings": settings, "operator": operator}
        )
        return result

    async def schedule_evaluation(self, name: str, duration_seconds: float | None = None) -> dict[str, Any]:
        """Open an evaluation round, taking reports for `duration_seconds` (default: the population's)."""
        params = {} if duration_seconds is None else {"duration_seconds": duration_seconds}
        result: dict[str, Any] = await self._request(EVALUATE, name, params=params)
        return result

    async def attach_mixing(
        self, name: str, mixing: dict[str, Any], examples: bytes | None
    ) -> dict[str, Any]:
        """Attach a mixing strategy (contracts.mixing) and centralized examples (safetensors)."""
        files = {"examples": ("examples.safetensors", examples)} if examples is not None else None
        result: dict[str, Any] = await self._request(
            ATTACH_MIXING, name, data={"mixing": json.dumps(mixing)}, files=files
        )
        return result
