"""The admin API as the console calls it: a route declared in `console.commands`, its answer as
JSON, a refusal or an unreachable server as one line."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from orchestrator.console.routes import POPULATION, AdminRoute


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

    def call(self, route: AdminRoute, *, params: dict[str, Any] | None = None, **request: Any) -> Any:
        """The JSON answer of an admin route (console.commands), its `{name}` from `request`;
        the rest of `request` (json=, data=, files=) goes to httpx as it is."""
        path = {k: request.pop(k) for k in list(request) if "{" + k + "}" in route.path}
        return self._request(route.method, route.url(**path), params=params, **request).json()

    def download(self, name: str, version: int | None, folder: Path) -> dict[str, Any]:
        """The population's model (`model.tflite`, checked against its sha256), manifest and global
        parameters at `version` (default: the current one) into `folder`, as `model_export` writes
        them; returns what was written."""
        population = self.call(POPULATION, name=name)
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
