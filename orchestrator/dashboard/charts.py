"""The dashboard's charts, drawn on the server as inline SVG.

No chart library and no script: a chart is a few rectangles and polylines, each mark with a
`<title>` (the browser shows it as a tooltip), so the pages need no JavaScript (their policy
forbids it) and nothing has to be vendored or built. Every text that came from the database
is escaped here.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Sequence
from html import escape

from markupsafe import Markup

from contracts.protocol import PrivacyView, RoundView
from orchestrator.dashboard.overview import FUNNEL, Series

WIDTH, HEIGHT, PAD = 640, 180, 36
COLORS = {"committed": "#2e7d32", "abandoned": "#c62828", "open": "#9e9e9e"}
TRAINING, EVALUATION = "#1565c0", "#ef6c00"


def _svg(body: Iterable[str], label: str, height: int = HEIGHT) -> Markup:
    inner = "".join(body)
    return Markup(
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{escape(label)}" '
        f'viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" class="chart">'
        f"<title>{escape(label)}</title>{inner}</svg>"
    )


def _text(x: float, y: float, text: str, anchor: str = "start", size: int = 11) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
        f'fill="#333">{escape(text)}</text>'
    )


def _clock(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC).strftime("%H:%M:%S UTC")


def round_outcome(r: RoundView) -> str:
    if r.status == "committed":
        return f"committed -> version {r.result_version}" if r.result_version is not None else "committed"
    if r.status == "abandoned":
        count = f", {r.devices_had} of {r.devices_needed} devices" if r.devices_had is not None else ""
        return f"abandoned in {r.stopped_phase or '?'} by {r.ended_by or '?'}{count}"
    return r.status


def rounds_over_time(rounds: Sequence[RoundView], now: float) -> Markup:
    """One bar per round at its opening time: its reports against its target, coloured by
    outcome (evaluation rounds paler)."""
    label = "Rounds over time: reports against target, by outcome"
    if not rounds:
        return _svg([_text(WIDTH / 2, HEIGHT / 2, "no rounds yet", "middle")], label)
    start = min(r.opened_at for r in rounds)
    end = max(now, max(r.closed_at or r.deadline for r in rounds))
    span = max(end - start, 1e-9)
    plot_w, plot_h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD
    bar_w = max(2.0, min(24.0, plot_w / max(len(rounds), 1) * 0.7))
    body = [
        f'<line x1="{PAD}" y1="{PAD + plot_h}" x2="{PAD + plot_w}" y2="{PAD + plot_h}" stroke="#999"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD + plot_w}" y2="{PAD}" stroke="#ddd" stroke-dasharray="4 3"/>',
        _text(PAD - 4, PAD + 4, "100%", "end", 10),
        _text(PAD - 4, PAD + plot_h, "0", "end", 10),
        _text(PAD, HEIGHT - 8, _clock(start)),
        _text(PAD + plot_w, HEIGHT - 8, _clock(end), "end"),
    ]
    for r in sorted(rounds, key=lambda r: r.id):
        reported = r.counters.get("reported", 0)
        fraction = min(reported / r.target, 1.0) if r.target else 0.0
        h = max(2.0, fraction * plot_h)  # an empty round still shows
        x = PAD + (r.opened_at - start) / span * (plot_w - bar_w)
        opacity = "1" if r.kind == "training" else "0.5"
        tip = f"round #{r.id} {r.kind}: {reported}/{r.target} reports; {round_outcome(r)}"
        if r.close_reason:
            tip += f" ({r.close_reason})"
        body.append(
            f'<rect class="round {escape(r.status)}" x="{x:.1f}" y="{PAD + plot_h - h:.1f}" '
            f'width="{bar_w:.1f}" height="{h:.1f}" fill="{COLORS.get(r.status, "#777")}" '
            f'fill-opacity="{opacity}"><title>{escape(tip)}</title></rect>'
        )
    legend_x = PAD
    for status, color in COLORS.items():
        body.append(f'<rect x="{legend_x}" y="8" width="10" height="10" fill="{color}"/>')
        body.append(_text(legend_x + 14, 17, status))
        legend_x += 90
    body.append(_text(legend_x, 17, "(paler: evaluation)"))
    return _svg(body, label)


def funnel(totals: dict[str, int]) -> Markup:
    """Check-ins, accepted, reported: one bar each, as long as its count."""
    label = "Participation funnel: checked in, accepted, reported"
    top = max([totals.get(k, 0) for k in FUNNEL] + [1])
    row, plot_w = 34, WIDTH - 2 * PAD - 120
    body = []
    for i, stage in enumerate(FUNNEL):
        count = totals.get(stage, 0)
        y = 10 + i * row
        w = max(1.0, count / top * plot_w)
        body.append(_text(PAD + 90, y + 16, stage.replace("_", " "), "end"))
        body.append(
            f'<rect class="stage" x="{PAD + 100}" y="{y}" width="{w:.1f}" height="{row - 10}" '
            f'fill="{TRAINING}"><title>{escape(f"{stage}: {count}")}</title></rect>'
        )
        body.append(_text(PAD + 106 + w, y + 16, str(count)))
    return _svg(body, label, height=10 + len(FUNNEL) * row)


def _scale(low: float, high: float) -> tuple[float, float]:
    if not (math.isfinite(low) and math.isfinite(high)):
        return 0.0, 1.0
    if high - low < 1e-12:
        return low - 0.5, high + 0.5
    return low, high


def metric(series: Series) -> Markup:
    """A metric by model version: training rounds' line and evaluation rounds' line."""
    label = f"{series.name} by model version"
    points = [p for p in (*series.training, *series.evaluation) if math.isfinite(p[1])]
    if not points:
        return _svg([_text(WIDTH / 2, HEIGHT / 2, "no values", "middle")], label)
    bounds = [p[1] for p in points] + [
        b for pair in series.intervals.values() for b in pair if math.isfinite(b)
    ]
    x_low, x_high = _scale(min(p[0] for p in points), max(p[0] for p in points))
    y_low, y_high = _scale(min(bounds), max(bounds))
    plot_w, plot_h = WIDTH - 2 * PAD - 30, HEIGHT - 2 * PAD
    left = PAD + 30

    def xy(version: float, value: float) -> tuple[float, float]:
        return (
            left + (version - x_low) / (x_high - x_low) * plot_w,
            PAD + plot_h - (value - y_low) / (y_high - y_low) * plot_h,
        )

    body = [
        f'<line x1="{left}" y1="{PAD + plot_h}" x2="{left + plot_w}" y2="{PAD + plot_h}" stroke="#999"/>',
        f'<line x1="{left}" y1="{PAD}" x2="{left}" y2="{PAD + plot_h}" stroke="#999"/>',
        _text(left - 4, PAD + 4, f"{y_high:.4g}", "end", 10),
        _text(left - 4, PAD + plot_h, f"{y_low:.4g}", "end", 10),
        _text(left, HEIGHT - 8, f"version {x_low:g}"),
        _text(left + plot_w, HEIGHT - 8, f"version {x_high:g}", "end"),
        _text(left, 17, series.name, size=12),
    ]
    for kind, color, values in (
        ("training", TRAINING, series.training),
        ("evaluation", EVALUATION, series.evaluation),
    ):
        finite = [p for p in values if math.isfinite(p[1])]
        if not finite:
            continue
        coords = [xy(v, y) for v, y in finite]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
        body.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for (v, y), (cx, cy) in zip(finite, coords, strict=True):
            tip = f"{kind}, version {v}: {series.name} = {y:.4g}"
            interval = series.intervals.get(v) if kind == "evaluation" else None
            if interval is not None:  # the evaluation's 95% interval as a whisker
                _, top = xy(v, interval[1])
                _, bottom = xy(v, interval[0])
                body.append(
                    f'<line x1="{cx:.1f}" y1="{top:.1f}" x2="{cx:.1f}" y2="{bottom:.1f}" '
                    f'stroke="{color}" stroke-width="1.5"/>'
                )
                tip += f" [95% interval {interval[0]:.4g}, {interval[1]:.4g}]"
            body.append(
                f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="{color}">'
                f"<title>{escape(tip)}</title></circle>"
            )
        body.append(_text(left + plot_w - (150 if kind == "training" else 60), 17, kind))
        body.append(
            f'<rect x="{left + plot_w - (164 if kind == "training" else 74)}" y="8" width="10" height="10" '
            f'fill="{color}"/>'
        )
    return _svg(body, label)


def budget(privacy: PrivacyView | None) -> Markup:
    """Epsilon spent against the budget, as a filled bar."""
    label = "Epsilon spent against the budget"
    height = 60
    if privacy is None:
        return _svg([_text(PAD, 34, "no differential privacy: no guarantee to spend")], label, height)
    if privacy.epsilon is None:
        return _svg([_text(PAD, 34, "no noise: epsilon is unbounded (no guarantee)")], label, height)
    if privacy.epsilon_budget is None:
        text = f"epsilon {privacy.epsilon:.3g} at delta {privacy.delta:g} (no budget set)"
        return _svg([_text(PAD, 34, text)], label, height)
    plot_w = WIDTH - 2 * PAD
    fraction = min(privacy.epsilon / privacy.epsilon_budget, 1.0) if privacy.epsilon_budget > 0 else 1.0
    color = COLORS["abandoned"] if privacy.budget_spent else COLORS["committed"]
    text = f"epsilon {privacy.epsilon:.3g} of {privacy.epsilon_budget:g} at delta {privacy.delta:g}"
    body = [
        f'<rect x="{PAD}" y="8" width="{plot_w}" height="20" fill="#eee" stroke="#999"/>',
        f'<rect class="spent" x="{PAD}" y="8" width="{fraction * plot_w:.1f}" height="20" fill="{color}">'
        f"<title>{escape(text)}</title></rect>",
        _text(PAD, 48, text),
    ]
    return _svg(body, label, height)
