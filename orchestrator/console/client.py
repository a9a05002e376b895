"""The admin API as the console calls it: one method per request, errors as one line."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx


class ConsoleError(Exception):
    """A request the server refused or could not answer, said in one line; `bad_input`: the
    operator's request was wrong (a 4xx), else the server or the network failed."""

    def __init__(self, message: str, bad_input: bool) -> None:
        super().__init__(message)
        self.bad_input = bad_input


class AdminClient:
    """A server's admin API at `url`, called with `token`."""

    def __init__(self, url: str, token: str, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout
        )

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise ConsoleError(f"cannot reach {self.url}: {e}", bad_input=False) from None
        if response.is_success:
            return response
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise ConsoleError(
            f"{method} {path}: {response.status_code} {detail}", bad_input=400 <= response.status_code < 500
        )

    @staticmethod
    def _population_path(name: str) -> str:
        return f"/v1/admin/populations/{quote(name, safe='')}"

    def populations(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self._request("GET", "/v1/admin/populations").json()
        return found

    def population(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self._request("GET", self._population_path(name)).json()
        return found

    def rounds(self, name: str, limit: int) -> list[dict[str, Any]]:
        path = f"{self._population_path(name)}/rounds"
        found: list[dict[str, Any]] = self._request("GET", path, params={"limit": limit}).json()
        return found

    def open_evaluation(self, name: str) -> dict[str, Any]:
        opened: dict[str, Any] = self._request("POST", f"{self._population_path(name)}/evaluations").json()
        return opened

    def pause(self, name: str) -> dict[str, Any]:
        paused: dict[str, Any] = self._request("POST", f"{self._population_path(name)}/pause").json()
        return paused

    def resume(self, name: str) -> dict[str, Any]:
        resumed: dict[str, Any] = self._request("POST", f"{self._population_path(name)}/resume").json()
        return resumed

    def archive(self, name: str) -> dict[str, Any]:
        archived: dict[str, Any] = self._request("POST", f"{self._population_path(name)}/archive").json()
        return archived

    def change_settings(self, name: str, settings: dict[str, Any], operator: str) -> dict[str, Any]:
        body = {"settings": settings, "operator": operator}
        changed: dict[str, Any] = self._request(
            "PATCH", f"{self._population_path(name)}/settings", json=body
        ).json()
        return changed

    def settings_changes(self, name: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self._request(
            "GET", f"{self._population_path(name)}/settings/changes"
        ).json()
        return found

    def download(self, name: str, version: int | None, folder: Path) -> dict[str, Any]:
        """The population's model (`model.tflite`, checked against its sha256), manifest and global
        parameters at `version` (default: the current one) into `folder`, as `model_export` writes
        them; returns what was written."""
        population = self.population(name)
        version = population["current_version"] if version is None else version
        sha256 = population["artifact_sha256"]
        model = self._request("GET", f"/v1/artifacts/{sha256}").content
        if hashlib.sha256(model).hexdigest() != sha256:
            raise ConsoleError(f"the model downloaded does not match its sha256 {sha256}", bad_input=False)
        device_path = f"/v1/populations/{quote(name, safe='')}"
        manifest = self._request("GET", f"{device_path}/manifest").content
        params = self._request("GET", f"{device_path}/models/{version}/global").content
        folder.mkdir(parents=True, exist_ok=True)
        files = {"model.tflite": model, "manifest.json": manifest, "global_params.safetensors": params}
        for file_name, content in files.items():
            (folder / file_name).write_bytes(content)
        return {
            "population": name,
            "version": version,
            "artifact_sha256": sha256,
            "folder": str(folder),
            "files": {file_name: len(content) for file_name, content in files.items()},
        }
