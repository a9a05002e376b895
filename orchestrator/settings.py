"""Server configuration, from the environment (ORCHESTRATOR_*) or a .env file."""

from __future__ import annotations

from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ORCHESTRATOR_", env_file=".env", extra="ignore")

    database_url: str = "sqlite:///orchestrator.sqlite"
    admin_token: str = "change-me"
    # A bearer token that opens GET /metrics and nothing else (for the Prometheus scraper); the
    # admin token opens it too. Empty: only the admin token.
    metrics_token: str = ""
    # Level of the JSON log lines on stderr; "debug" adds one line per request.
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    host: str = "127.0.0.1"
    port: int = 8700
    # How often the server looks for rounds past their deadline (devices also trigger it).
    tick_seconds: float = 0.5
    # Check-ins (per population) and reports that arrive together share one transaction; this is
    # the longest a request waits for others to join it (api/group_commit.py).
    group_commit_seconds: float = 0.001
    # Threads for blocking work (database, report validation).
    worker_threads: int = 4
    # Largest request body accepted (a dense 20,000 x 50 float32 delta is 4 MB).
    max_report_bytes: int = 64 * 1024 * 1024
