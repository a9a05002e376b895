"""The dashboard's charts over time of the rounds that closed: how long each took, and what share
of its accepted devices reported or were dropped. Inline SVG like charts.py, which draws the rest."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from markupsafe import Markup

from contracts.protocol import RoundView
from orchestrator.dashboard.charts import (
    EVALUATION,
    HEIGHT,
    PAD,
    TRAINING,
    WIDTH,
    _svg,
    _text,
    seconds,
    time_axis,
)
from orchestrator.dashboard.overview import idle

DROPPED = "#c62828"
LEFT, RIGHT, TOP, BOTTOM = PAD + 30, WIDTH - 8, 34, HEIGHT - 22


def _closed(rounds: Sequence[RoundView]) -> list[RoundView]:
    """Closed rounds a device came to, oldest first (an idle round took its deadline by definition)."""
    return sorted((r for r in rounds if r.closed_at is not None and not idle(r)), key=lambda r: r.id)


def _frame(closed: list[RoundView], y_high: float, unit: str, label: str) -> tuple[list[str], float, float]:
    start, end = closed[0].opened_at, max(r.closed_at or r.opened_at for r in closed)
    body = [
        *time_axis(start, end, LEFT, RIGHT, BOTTOM),
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{BOTTOM}" stroke="#999"/>',
        _text(LEFT - 4, TOP + 4, f"{y_high:.3g}", "end", 10),
        _text(LEFT - 4, BOTTOM, "0", "end", 10),
        _text(4, TOP - 10, unit, size=10, cls="axis"),
    ]
    return body, start, max(end - start, 1e-9)


def _line(points: list[tuple[float, float, str]], color: str, name: str) -> list[str]:
    if not points:
        return []
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in points)
    body = [f'<polyline class="{name}" points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>']
    body += [
        f'<circle class="{name}" cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}">'
        f"<title>{escape(t)}</title></circle>"
        for x, y, t in points
    ]
    return body


def _legend(entries: Sequence[tuple[str, str]]) -> list[str]:
    body, x = [], RIGHT - 110 * len(entries)
    for name, color in entries:
        body.append(f'<rect x="{x}" y="6" width="10" height="10" fill="{color}"/>')
        body.append(_text(x + 14, 15, name))
        x += 110
    return body


def durations(rounds: Sequence[RoundView]) -> Markup:
    """Each closed round's duration, from open to close, at its opening time, by kind."""
    label = "Round durations over time (seconds from open to close)"
    closed = _closed(rounds)
    if not closed:
        return _svg([_text(WIDTH / 2, HEIGHT / 2, "no closed rounds with devices yet", "middle")], label)
    high = max((r.closed_at or r.opened_at) - r.opened_at for r in closed) or 1.0
    body, start, span = _frame(closed, high, "duration (s)", label)
    for kind, color in (("training", TRAINING), ("evaluation", EVALUATION)):
        points = []
        for r in closed:
            if r.kind != kind:
                continue
            took = (r.closed_at or r.opened_at) - r.opened_at
            x = LEFT + (r.opened_at - start) / span * (RIGHT - LEFT)
            y = BOTTOM - took / high * (BOTTOM - TOP)
            points.append((x, y, f"round #{r.id} {kind}: {seconds(took)}, {r.status}"))
        body += _line(points, color, f"duration {kind}")
    body += _legend((("training", TRAINING), ("evaluation", EVALUATION)))
    return _svg(body, label)


def rates(rounds: Sequence[RoundView]) -> Markup:
    """Each closed round's share of accepted devices that reported, and that were dropped."""
    label = "Report and drop rates over time (% of each round's accepted devices)"
    closed = [r for r in _closed(rounds) if r.counters.get("accepted", 0)]
    if not closed:
        return _svg([_text(WIDTH / 2, HEIGHT / 2, "no closed rounds with devices yet", "middle")], label)
    body, start, span = _frame(closed, 100, "% of accepted", label)
    for name, counter, color in (("reported", "reported", TRAINING), ("dropped", "dropped", DROPPED)):
        points = []
        for r in closed:
            share = 100 * r.counters.get(counter, 0) / r.counters["accepted"]
            x = LEFT + (r.opened_at - start) / span * (RIGHT - LEFT)
            y = BOTTOM - share / 100 * (BOTTOM - TOP)
            points.append((x, y, f"round #{r.id} {r.kind}: {share:.0f}% {name}"))
        body += _line(points, color, f"rate {name}")
    body += _legend((("reported", TRAINING), ("dropped", DROPPED)))
    return _svg(body, label)
