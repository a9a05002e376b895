"""The dashboard's pages and forms. HTML for a browser, not part of the API: they are left out of
the OpenAPI document (docs/reference/http-protocol.md lists them in a table of their own).

Signing in posts the admin token once (never in a URL); the answer sets the session cookie
(sessions.py). Every page but the sign-in form needs the session; every form that changes
something (pause, resume, sign out) needs the session's CSRF token as well. A form posted from
another site (the browser's `Sec-Fetch-Site`) is refused before anything else, sign-in included:
a hostile page can neither sign an operator in nor use up their address's sign-in attempts.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.api.deps import is_admin, run_db
from orchestrator.api.rate_limits import TokenBuckets
from orchestrator.console.render import duration, when
from orchestrator.dashboard import buffer_charts, charts, overview, sessions, trends
from orchestrator.populations.locks import lock_population
from orchestrator.rounds import pausing
from orchestrator.rounds.lifecycle import advance

log = logging.getLogger("orchestrator")
router = APIRouter(include_in_schema=False)
HOME = "/dashboard"
REFRESH_SECONDS = 5
HERE = Path(__file__).parent
TEMPLATES = Environment(
    loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]), auto_reload=False
)
TEMPLATES.globals.update(
    when=when,
    duration=duration,
    charts=charts,
    buffer_charts=buffer_charts,
    trends=trends,
    outcome=charts.round_outcome,
    status_of=charts.status_of,
)
STYLE = (HERE / "style.css").read_bytes()
# No script of any kind, no other origin; forms post only here; no framing (clickjacking).
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def answers(success: int, media: str, refusals: dict[int, str] | None = None) -> dict[int | str, Any]:
    """A page's answers, as `responses`: not for the OpenAPI document (the pages are not in it),
    but what docs/reference/http-protocol.md's dashboard table is checked against."""
    declared: dict[int | str, Any] = {success: {"description": media}}
    declared.update({status: {"description": why} for status, why in (refusals or {}).items()})
    return declared


# Every page and form may answer these as well: a body over the limit, the database unavailable.
EDGE = {413: "the body is over max_request_bytes", 503: "the database is busy or unavailable"}
FORM = {**EDGE, 422: "a form field over its length"}
CHANGE = {**FORM, 401: "no valid session", 403: "a missing or wrong CSRF token, or a form from another site"}
# What a browser says of a form posted by a page of another origin (Fetch Metadata).
OTHER_SITES = frozenset({"cross-site", "same-site"})


def sign_in_buckets(burst: int, interval_seconds: float) -> TokenBuckets:
    """The sign-in form's rate limit per client address (kept on app.state.dashboard_sign_ins)."""
    return TokenBuckets(1.0 / interval_seconds, burst)


def _page(name: str, status: int = 200, headers: dict[str, str] | None = None, **context: Any) -> Response:
    html = TEMPLATES.get_template(name).render(**context)
    return Response(html, status_code=status, media_type="text/html", headers={**HEADERS, **(headers or {})})


def _redirect(to: str) -> RedirectResponse:
    return RedirectResponse(to, status_code=303, headers=HEADERS)


def _address(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def _expires_at(factory: sessionmaker[Session], secret: str | None, now: float) -> float | None:
    with factory() as session:
        return sessions.expires_at(session, secret, now)


async def _session(request: Request) -> str | None:
    """The secret of the caller's valid session, or None."""
    secret = request.cookies.get(sessions.COOKIE)
    app = request.app
    found = await run_db(app, _expires_at, app.state.sessionmaker, secret, app.state.clock())
    return secret if found is not None else None


def _from_another_site(request: Request) -> Response | None:
    """The refusal of a form that a page of another origin made the browser post, or None."""
    if request.headers.get("sec-fetch-site", "").lower() not in OTHER_SITES:
        return None
    log.warning("dashboard: a form from another site refused", extra={"address": _address(request)})
    return _page(
        "error.html", 403, error="a form posted from another site is refused: use the dashboard's own page"
    )


def _csrf(request: Request, secret: str) -> str:
    return sessions.csrf_token(request.app.state.admin_token_digest, secret)


@router.get("/", responses=answers(303, "to /dashboard"))
async def root() -> RedirectResponse:
    return _redirect(HOME)


@router.get(f"{HOME}/style.css", responses=answers(200, "text/css", EDGE))
async def style() -> Response:
    return Response(STYLE, media_type="text/css", headers={**HEADERS, "Cache-Control": "max-age=3600"})


@router.get(HOME, responses=answers(200, "text/html", EDGE))
async def home(request: Request) -> Response:
    secret = await _session(request)
    if secret is None:
        return _page("sign_in.html")
    app = request.app
    now = app.state.clock()
    found = await run_db(app, overview.populations, app.state.sessionmaker, now)
    return _page(
        "index.html", populations=found, csrf=_csrf(request, secret), now=now, refresh=REFRESH_SECONDS
    )


def _start(factory: sessionmaker[Session], now: float, lifetime: float, address: str) -> str:
    with factory.begin() as session:
        return sessions.start(session, now, lifetime, address)


@router.post(
    f"{HOME}/sign-in",
    responses=answers(
        303,
        "to /dashboard",
        {**FORM, 401: "a wrong admin token", 403: "a form from another site", 429: "too many sign-ins"},
    ),
)
async def sign_in(request: Request, token: Annotated[str, Form(max_length=1000)] = "") -> Response:
    refusal = _from_another_site(request)  # before the rate limit: it must not use up attempts
    if refusal is not None:
        return refusal
    app, address = request.app, _address(request)
    buckets: TokenBuckets = app.state.dashboard_sign_ins
    wait = buckets.take(address, app.state.clock())
    if wait > 0:
        retry = max(1, math.ceil(wait))
        log.warning("dashboard: sign-in refused, too many attempts", extra={"address": address})
        return _page(
            "sign_in.html",
            429,
            {"Retry-After": str(retry)},
            error=f"too many sign-in attempts from this address; retry in {retry} s",
        )
    if not is_admin(app, token.strip()):  # constant time (api/deps.py)
        log.warning("dashboard: sign-in with a wrong admin token", extra={"address": address})
        return _page("sign_in.html", 401, error="wrong admin token")
    settings = app.state.settings
    lifetime = settings.dashboard_session_seconds
    secret = await run_db(app, _start, app.state.sessionmaker, app.state.clock(), lifetime, address)
    log.info("dashboard: signed in", extra={"address": address})
    answer = _redirect(HOME)
    answer.set_cookie(
        sessions.COOKIE,
        secret,
        max_age=math.ceil(lifetime),
        path=HOME,
        secure=request.url.scheme == "https",
        httponly=True,
        samesite="strict",
    )
    return answer


def _end(factory: sessionmaker[Session], secret: str) -> None:
    with factory.begin() as session:
        sessions.end(session, secret)


async def _checked(request: Request, csrf: str) -> tuple[str | None, Response | None]:
    """The caller's session, or the refusal of a change: no session (401), a missing or wrong
    CSRF token or a form from another site (403)."""
    refusal = _from_another_site(request)
    if refusal is not None:
        return None, refusal
    secret = await _session(request)
    if secret is None:
        return None, _page("error.html", 401, error="sign in first: your session ended or never began")
    if not sessions.csrf_ok(request.app.state.admin_token_digest, secret, csrf):
        log.warning(
            "dashboard: a change without its CSRF token refused", extra={"address": _address(request)}
        )
        return None, _page("error.html", 403, error="missing or wrong CSRF token: reload the page and retry")
    return secret, None


@router.post(f"{HOME}/sign-out", responses=answers(303, "to /dashboard", CHANGE))
async def sign_out(request: Request, csrf: Annotated[str, Form(max_length=200)] = "") -> Response:
    secret, refusal = await _checked(request, csrf)
    if refusal is not None or secret is None:
        return refusal or _redirect(HOME)
    await run_db(request.app, _end, request.app.state.sessionmaker, secret)
    log.info("dashboard: signed out", extra={"address": _address(request)})
    answer = _redirect(HOME)
    answer.delete_cookie(sessions.COOKIE, path=HOME, httponly=True, samesite="strict")
    return answer


@router.get(HOME + "/populations/{name}", responses=answers(200, "text/html", {**EDGE, 404: "no population"}))
async def population(name: str, request: Request) -> Response:
    secret = await _session(request)
    if secret is None:
        return _redirect(HOME)
    app = request.app
    now = app.state.clock()
    page = await run_db(app, overview.population_page, app.state.sessionmaker, name, now)
    if page is None:
        return _page("error.html", 404, error=f"no population {name!r}")
    return _page("population.html", page=page, csrf=_csrf(request, secret), now=now, refresh=REFRESH_SECONDS)


def _pause_or_resume(factory: sessionmaker[Session], name: str, pause: bool, now: float) -> str | None:
    """Pause or resume `name`; an error to show, or None when done."""
    with factory.begin() as session:
        found = lock_population(session, name)
        if found is None:
            return f"no population {name!r}"
        if pause:
            pausing.pause(session, found, now)
            return None
        try:
            pausing.resume(session, found, now)
        except pausing.ArchivedError as e:
            return str(e)
        advance(session, found, now)
        return None


async def _change(request: Request, name: str, csrf: str, pause: bool) -> Response:
    _, refusal = await _checked(request, csrf)
    if refusal is not None:
        return refusal
    app = request.app
    error = await run_db(app, _pause_or_resume, app.state.sessionmaker, name, pause, app.state.clock())
    if error is not None:
        return _page("error.html", 404 if error.startswith("no population") else 409, error=error)
    what = "paused" if pause else "resumed"
    log.info(f"dashboard: population {what}", extra={"population": name, "address": _address(request)})
    return _redirect(f"{HOME}/populations/{name}")


@router.post(
    HOME + "/populations/{name}/pause",
    responses=answers(303, "to its page", {**CHANGE, 404: "no population"}),
)
async def pause(name: str, request: Request, csrf: Annotated[str, Form(max_length=200)] = "") -> Response:
    return await _change(request, name, csrf, pause=True)


@router.post(
    HOME + "/populations/{name}/resume",
    responses=answers(303, "to its page", {**CHANGE, 404: "no population", 409: "archived"}),
)
async def resume(name: str, request: Request, csrf: Annotated[str, Form(max_length=200)] = "") -> Response:
    return await _change(request, name, csrf, pause=False)
