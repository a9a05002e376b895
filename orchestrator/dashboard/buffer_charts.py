"""A buffered population's charts (`rounds: buffered`): the open buffer's fill, the staleness of
the reports counted lately, versions committed per hour, and what the finished participations
came to. Inline SVG like charts.py; the figures are `contracts.protocol.BufferView`'s."""

from __future__ import annotations

import datetime
from html import escape

from markupsafe import Markup

from contracts.protocol import BufferView
from orchestrator.dashboard.charts import HEIGHT, PAD, TRAINING, WIDTH, _integer_ticks, _svg, _text, seconds

LEFT, RIGHT, TOP, BOTTOM = PAD + 30, WIDTH - 8, 30, HEIGHT - 30
# What a finished participation came to, each its colour (the funnel's where they match).
OUTCOMES = {
    "counted": ("counted", "#2e7d32"),
    "refused_stale": ("refused as too stale", "#ef6c00"),
    "expired": ("dropped at its deadline", "#c62828"),
    "invalid": ("invalid or aborted", "#6a1b9a"),
}


def finished(view: BufferView) -> int:
    return view.counted + view.refused_stale + view.expired + view.invalid


def idle(view: BufferView) -> bool:
    """Nothing in the open buffer, no participation finished in the window."""
    return not view.open_reports and not finished(view)


def fill(view: BufferView, now: float) -> Markup:
    """The open buffer's reports against the buffer size, and how long it has been open."""
    label = "The open buffer's fill: reports in it against buffer_size"
    height = 60
    if view.open_round_id is None or view.open_since is None:
        return _svg([_text(PAD, 34, "no buffer open", cls="idle")], label, height)
    plot_w = WIDTH - 2 * PAD
    fraction = min(view.open_reports / view.buffer_size, 1.0) if view.buffer_size else 0.0
    text = (
        f"buffer #{view.open_round_id}: {view.open_reports} of {view.buffer_size} reports, "
        f"open for {seconds(max(now - view.open_since, 0.0))}"
    )
    if not view.open_reports:
        text += " (idle: no report yet)" if idle(view) else " (no report yet)"
    body = [
        f'<rect x="{PAD}" y="8" width="{plot_w}" height="20" fill="#eee" stroke="#999"/>',
        f'<rect class="fill" x="{PAD}" y="8" width="{fraction * plot_w:.1f}" height="20" '
        f'fill="{TRAINING}"><title>{escape(text)}</title></rect>',
        _text(PAD, 48, text),
    ]
    return _svg(body, label, height)


def _bars(counts: list[int], names: list[str], tips: list[str], cls: str) -> list[str]:
    """Vertical bars of `counts` over the plot, one slot each; their y axis."""
    high = max([*counts, 1])
    slot = (RIGHT - LEFT) / max(len(counts), 1)
    body = [
        f'<line x1="{LEFT}" y1="{BOTTOM}" x2="{RIGHT}" y2="{BOTTOM}" stroke="#999"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{BOTTOM}" stroke="#999"/>',
        _text(LEFT - 4, TOP + 4, str(high), "end", 10),
        _text(LEFT - 4, BOTTOM, "0", "end", 10),
    ]
    for i, (count, name, tip) in enumerate(zip(counts, names, tips, strict=True)):
        h = count / high * (BOTTOM - TOP)
        x = LEFT + i * slot
        body.append(
            f'<rect class="{cls}" data-{cls}="{escape(name)}" data-count="{count}" x="{x + 1:.1f}" '
            f'y="{BOTTOM - h:.1f}" width="{max(slot - 2, 1):.1f}" height="{h:.1f}" fill="{TRAINING}">'
            f"<title>{escape(tip)}</title></rect>"
        )
    return body


def staleness(view: BufferView) -> Markup:
    """The reports counted into the window's buffers, by staleness (whole versions)."""
    label = "Staleness of the counted reports: reports by versions behind"
    counts = view.staleness_counts
    if not sum(counts):
        return _svg(
            [_text(WIDTH / 2, HEIGHT / 2, "idle: no report counted yet", "middle", cls="idle")], label
        )
    tips = [f"{n} reports {s} versions stale" for s, n in enumerate(counts)]
    body = _bars(counts, [str(s) for s in range(len(counts))], tips, "staleness")
    slot = (RIGHT - LEFT) / len(counts)
    for s in _integer_ticks(0, len(counts) - 1, 12):  # versions are whole numbers
        body.append(_text(LEFT + (s + 0.5) * slot, BOTTOM + 14, str(s), "middle", 10, "version"))
    body.append(_text((LEFT + RIGHT) / 2, HEIGHT - 4, "staleness (versions behind)", "middle", 10, "axis"))
    body.append(_text(4, TOP - 10, "reports", size=10, cls="axis"))
    return _svg(body, label)


def _hour(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC).strftime("%H:00")


def versions_per_hour(view: BufferView) -> Markup:
    """Versions committed in each of the last 24 hours, the current one last."""
    label = "Versions committed per hour over the last 24 hours (UTC)"
    counts, start = view.versions_per_hour, view.hours_start or 0.0
    if not sum(counts):
        text = f"idle: no version committed in the last {len(counts)} h"
        return _svg([_text(WIDTH / 2, HEIGHT / 2, text, "middle", cls="idle")], label)
    hours = [start + i * 3600 for i in range(len(counts))]
    tips = [f"{_hour(h)}-{_hour(h + 3600)} UTC: {n} versions" for h, n in zip(hours, counts, strict=True)]
    body = _bars(counts, [_hour(h) for h in hours], tips, "hour")
    slot = (RIGHT - LEFT) / len(counts)
    for i in range(0, len(counts), 4):
        body.append(_text(LEFT + i * slot, BOTTOM + 14, _hour(hours[i]), size=10))
    body.append(_text((LEFT + RIGHT) / 2, HEIGHT - 4, "hour (UTC)", "middle", 10, "axis"))
    body.append(_text(4, TOP - 10, "versions / hour", size=10, cls="axis"))
    return _svg(body, label)


def counted_share(view: BufferView) -> Markup:
    """The window's finished participations, split by what they came to."""
    label = "Finished participations: counted, refused as too stale, dropped, invalid (devices)"
    height = 70
    total = finished(view)
    if not total:
        return _svg([_text(PAD, 34, "idle: no participation finished yet", cls="idle")], label, height)
    plot_w, x = WIDTH - 2 * PAD, float(PAD)
    body = []
    legend_x = PAD
    for name, (words, color) in OUTCOMES.items():
        count = getattr(view, name)
        tip = f"{words}: {count} of {total} ({100 * count / total:.0f}%)"
        if count:
            w = count / total * plot_w
            body.append(
                f'<rect class="outcome {name}" data-count="{count}" x="{x:.1f}" y="8" width="{w:.1f}" '
                f'height="22" fill="{color}" stroke="#fff" stroke-width="0.5">'
                f"<title>{escape(tip)}</title></rect>"
            )
            x += w
        body.append(f'<rect x="{legend_x}" y="42" width="10" height="10" fill="{color}"/>')
        entry = f"{words} {count}"
        body.append(_text(legend_x + 14, 51, entry, size=10))
        legend_x += 26 + 6 * len(entry)  # about 6 px a character at 10 px
    body.append(
        _text(PAD, 66, f"{total} devices finished; {100 * view.counted / total:.0f}% counted", size=10)
    )
    return _svg(body, label, height)
