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
from orchestrator.dashboard.overview import ACCEPTED, CHECKED_IN, FUNNEL, Series, idle

WIDTH, HEIGHT, PAD = 640, 180, 36
# Idle (no device came) is grey like an open round's bar outline: nothing failed.
COLORS = {"committed": "#2e7d32", "abandoned": "#c62828", "idle": "#bdbdbd", "open": "#90a4ae"}
TRAINING, EVALUATION = "#1565c0", "#ef6c00"
# The funnel's parts (overview.CHECKED_IN, overview.ACCEPTED), each its colour.
PARTS = {
    "accepted": TRAINING,
    "rejected_capacity": "#90caf9",
    "rejected_min_examples": "#b0bec5",
    "refused_otherwise": "#cfd8dc",
    "reported": "#2e7d32",
    "in_task": "#9e9e9e",
    "outrun": "#aed581",
    "dropped": "#c62828",
    "invalid": "#6a1b9a",
    "aborted": "#ef6c00",
}


def _svg(body: Iterable[str], label: str, height: int = HEIGHT) -> Markup:
    inner = "".join(body)
    return Markup(
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{escape(label)}" '
        f'viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" class="chart">'
        f"<title>{escape(label)}</title>{inner}</svg>"
    )


def _text(x: float, y: float, text: str, anchor: str = "start", size: int = 11, cls: str = "") -> str:
    kind = f' class="{cls}"' if cls else ""
    return (
        f'<text{kind} x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
        f'fill="#333">{escape(text)}</text>'
    )


def _clock(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC).strftime("%H:%M:%S UTC")


def seconds(value: float) -> str:
    """A duration as a person reads it: 4.2 s, 3 min 5 s, 2 h 10 min."""
    if value < 60:
        return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"
    if value < 3600:
        return f"{int(value // 60)} min {int(value % 60)} s"
    return f"{int(value // 3600)} h {int(value % 3600 // 60)} min"


def status_of(r: RoundView) -> str:
    """The round's class on the page: its status, or idle for one no device came to."""
    return "idle" if idle(r) else r.status


def round_outcome(r: RoundView) -> str:
    if r.status == "committed":
        return f"committed -> version {r.result_version}" if r.result_version is not None else "committed"
    if idle(r):
        return f"no devices: closed empty by {r.ended_by or 'its deadline'}"
    if r.status == "abandoned":
        count = f", {r.devices_had} of {r.devices_needed} devices" if r.devices_had is not None else ""
        return f"abandoned in {r.stopped_phase or '?'} by {r.ended_by or '?'}{count}"
    return r.status


def time_axis(start: float, end: float, left: float, right: float, bottom: float) -> list[str]:
    """The x axis of a chart over time: its line, its ends' clock times and its unit."""
    return [
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#999"/>',
        _text(left, bottom + 14, _clock(start), size=10),
        _text(right, bottom + 14, _clock(end), "end", 10),
        _text((left + right) / 2, bottom + 14, "time (UTC)", "middle", 10, "axis"),
    ]


def rounds_over_time(rounds: Sequence[RoundView], now: float) -> Markup:
    """Each round a mark from its opening to its close (now, if open), in a lane by kind: as
    tall as its reports against its target, coloured by outcome, apart from its neighbours."""
    label = "Rounds over time: one mark per round, from open to close, its height reports / target"
    if not rounds:
        return _svg([_text(WIDTH / 2, HEIGHT / 2, "no rounds yet", "middle")], label)
    start = min(r.opened_at for r in rounds)
    end = max(now, max(r.closed_at or r.deadline for r in rounds))
    span = max(end - start, 1e-9)
    left, right, top, bottom = PAD + 54, WIDTH - 8, 36, HEIGHT - 22
    lane = (bottom - top) / 2
    body = time_axis(start, end, left, right, bottom)
    for i, kind in enumerate(("training", "evaluation")):
        y0 = top + i * lane
        body.append(_text(left - 6, y0 + lane / 2 + 4, kind, "end", 10))
        body.append(
            f'<line x1="{left}" y1="{y0 + lane - 2}" x2="{right}" y2="{y0 + lane - 2}" stroke="#eee"/>'
        )
    body.append(_text(4, top - 4, "height: reports / target (%)", size=10, cls="axis"))
    for r in sorted(rounds, key=lambda r: r.id):
        reported = r.counters.get("reported", 0)
        fraction = min(reported / r.target, 1.0) if r.target else 0.0
        y0 = top + (0 if r.kind == "training" else lane)
        h = max(3.0, fraction * (lane - 6))  # an empty round still shows
        closed = r.closed_at if r.closed_at is not None else now
        x = left + (r.opened_at - start) / span * (right - left)
        w = max(2.0, (closed - r.opened_at) / span * (right - left) - 1)  # 1 px apart
        status = status_of(r)
        tip = (
            f"round #{r.id} {r.kind}: {reported}/{r.target} reports in {seconds(closed - r.opened_at)}; "
            f"{round_outcome(r)}"
        )
        if r.close_reason:
            tip += f" ({r.close_reason})"
        body.append(
            f'<rect class="round {escape(status)}" x="{x:.1f}" y="{y0 + lane - 2 - h:.1f}" '
            f'width="{w:.1f}" height="{h:.1f}" fill="{COLORS.get(status, "#777")}" stroke="#fff" '
            f'stroke-width="0.5" data-kind="{escape(r.kind)}"><title>{escape(tip)}</title></rect>'
        )
    legend_x = left
    for status, color in COLORS.items():
        body.append(f'<rect x="{legend_x}" y="6" width="10" height="10" fill="{color}"/>')
        body.append(_text(legend_x + 14, 15, "no devices" if status == "idle" else status))
        legend_x += 95
    return _svg(body, label)


def _stacked(y: float, parts: Sequence[tuple[str, int]], top: int, plot_w: float, x0: float) -> list[str]:
    body, x = [], x0
    for name, count in parts:
        if not count:
            continue
        w = count / top * plot_w
        tip = f"{name.replace('_', ' ')}: {count}"
        body.append(
            f'<rect class="part {name}" x="{x:.1f}" y="{y}" width="{w:.1f}" height="22" '
            f'fill="{PARTS.get(name, TRAINING)}" stroke="#fff" stroke-width="0.5">'
            f"<title>{escape(tip)}</title></rect>"
        )
        x += w
    return body


def funnel(totals: dict[str, int]) -> Markup:
    """Checked in, accepted, reported: each a bar as long as its count, split into the parts
    that add up to it (where the check-ins and the accepted devices went)."""
    label = "Participation funnel: checked in, accepted, reported (devices), each split into its parts"
    top = max([totals.get(k, 0) for k in FUNNEL] + [1])
    row, x0 = 34, PAD + 80
    plot_w = WIDTH - x0 - 60
    body = []
    rows = {
        "checked_in": [(k, totals.get(k, 0)) for k in CHECKED_IN],
        "accepted": [(k, totals.get(k, 0)) for k in ACCEPTED],
        "reported": [("reported", totals.get("reported", 0))],
    }
    for i, stage in enumerate(FUNNEL):
        y = 10 + i * row
        count = totals.get(stage, 0)
        body.append(_text(x0 - 8, y + 15, stage.replace("_", " "), "end"))
        body += _stacked(y, rows[stage], top, plot_w, x0)
        body.append(_text(x0 + 4 + count / top * plot_w, y + 15, str(count)))
    body.append(_text(x0, 10 + len(FUNNEL) * row + 4, "devices", size=10, cls="axis"))
    return _svg(body, label, height=18 + len(FUNNEL) * row)


def _scale(low: float, high: float) -> tuple[float, float]:
    if not (math.isfinite(low) and math.isfinite(high)):
        return 0.0, 1.0
    if high - low < 1e-12:
        return low - 0.5, high + 0.5
    return low, high


def _integer_ticks(first: int, last: int, most: int = 8) -> list[int]:
    """Whole versions from `first` to `last`, at most `most` of them, evenly stepped."""
    step = max(1, math.ceil((last - first) / (most - 1)))
    ticks = list(range(first, last + 1, step))
    return ticks if ticks[-1] == last else [*ticks, last]


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

    first, last = min(p[0] for p in points), max(p[0] for p in points)
    body = [
        f'<line x1="{left}" y1="{PAD + plot_h}" x2="{left + plot_w}" y2="{PAD + plot_h}" stroke="#999"/>',
        f'<line x1="{left}" y1="{PAD}" x2="{left}" y2="{PAD + plot_h}" stroke="#999"/>',
        _text(left - 4, PAD + 4, f"{y_high:.4g}", "end", 10),
        _text(left - 4, PAD + plot_h, f"{y_low:.4g}", "end", 10),
        _text(left, 17, series.name, size=12),
        _text(left + plot_w / 2, HEIGHT - 8, "model version", "middle", 10, "axis"),
    ]
    for version in _integer_ticks(first, last):  # versions are whole numbers: never "4.5"
        x, _ = xy(version, y_low)
        body.append(
            f'<line x1="{x:.1f}" y1="{PAD + plot_h}" x2="{x:.1f}" y2="{PAD + plot_h + 4}" stroke="#999"/>'
        )
        body.append(_text(x, PAD + plot_h + 15, str(version), "middle", 10, "version"))
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
