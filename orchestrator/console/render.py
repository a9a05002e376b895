"""The admin API's answers as text for a person: readable times, one line per round."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.rounds.buffering import STALENESS_COUNT

SECURE_PHASE_METRIC = ("secure_", "_seconds")  # secure_phases.phase_seconds_metric's names


def when(epoch: float | None) -> str:
    """An epoch time as UTC to the second, or '-'."""
    if epoch is None:
        return "-"
    moment = datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def outcome(round_: Mapping[str, Any]) -> str:
    """What became of a round, with why when it did not commit."""
    status = str(round_["status"])
    if status == "committed" and round_.get("result_version") is not None:
        return f"committed -> version {round_['result_version']}"
    if status == "abandoned":
        where = round_.get("stopped_phase") or "?"
        had, needed = round_.get("devices_had"), round_.get("devices_needed")
        count = f", {had} of {needed} devices" if had is not None and needed is not None else ""
        return f"abandoned in {where} by {round_.get('ended_by') or '?'}{count}"
    return status


def phase_timings(round_: Mapping[str, Any]) -> str:
    """A secure round's phases and how long each lasted, e.g. 'advertise 3.0 s, share_keys 1.2 s'."""
    prefix, suffix = SECURE_PHASE_METRIC
    phases = [
        f"{name.removeprefix(prefix).removesuffix(suffix)} {duration(value)}"
        for name, value in round_.get("metrics", {}).items()
        if name.startswith(prefix) and name.endswith(suffix) and name != "unmask_seconds"
    ]
    return ", ".join(phases)


def evaluation_figures(round_: Mapping[str, Any]) -> str:
    """A committed evaluation round's means with their 95% intervals, e.g. 'loss 0.391 [0.35,
    0.43], accuracy 0.866 [0.84, 0.89] (95% intervals from 8 groups of devices)'."""
    metrics = round_.get("metrics", {})
    if round_.get("kind") != "evaluation" or "weight_sum" not in metrics:
        return ""
    names = ["loss", *(n for n in ("rmse", "accuracy") if n in metrics)]
    shown = []
    for name in names:
        low, high = metrics.get(f"{name}_low"), metrics.get(f"{name}_high")
        interval = f" [{low:.3g}, {high:.3g}]" if low is not None and high is not None else ""
        shown.append(f"{name} {metrics[name]:.3g}{interval}" if name in metrics else "")
    groups = metrics.get("interval_groups")
    spread = (
        f"95% intervals from {groups:.0f} groups of devices" if groups else "too few devices for an interval"
    )
    return ", ".join(s for s in shown if s) + f" ({spread})"


def buffer_staleness(metrics: Mapping[str, float]) -> str:
    """A buffered round's reports by staleness (versions behind), from its metrics; "" otherwise."""
    counts = {
        int(name.removeprefix(STALENESS_COUNT)): int(value)
        for name, value in metrics.items()
        if name.startswith(STALENESS_COUNT)
    }
    if not counts:
        return ""
    by = ", ".join(f"{s}: {n}" for s, n in sorted(counts.items()))
    return f"staleness mean {metrics.get('staleness_mean', 0.0):.2f} versions; reports by staleness {by}"


def round_line(round_: Mapping[str, Any], now: float) -> str:
    counters = round_.get("counters", {})
    closed = round_.get("closed_at")
    took = (closed if closed is not None else now) - round_["opened_at"]
    line = (
        f"#{round_['id']:<5} {round_['kind']:<10} opened {when(round_['opened_at'])}  "
        f"{'took' if closed is not None else 'open for'} {duration(took):>9}  "
        f"reports {round_.get('counters', {}).get('reported', 0)}/{round_['target']} "
        f"(checked in {counters.get('checked_in', 0)})  {outcome(round_)}"
    )
    phases = phase_timings(round_)
    if phases:
        line += f"\n       phases: {phases}"
    staleness = buffer_staleness(round_.get("metrics", {}))
    if staleness:
        line += f"\n       buffer: {staleness}"
    figures = evaluation_figures(round_)
    if figures:
        line += f"\n       figures: {figures}"
    reason = round_.get("close_reason")
    if reason:
        line += f"\n       why: {reason}"
    return line


def populations(found: Sequence[Mapping[str, Any]], now: float) -> str:
    if not found:
        return "no populations"
    lines = [f"{'NAME':<24} {'VERSION':>7} {'COMMITTED':>9}  {'OPEN ROUNDS':<22} LAST CLOSED ROUND"]
    for p in found:
        open_rounds = ", ".join(f"{r['kind']} #{r['id']}" for r in p.get("open_rounds", [])) or "-"
        if p.get("backing_off"):
            open_rounds = "none (backing off)"
        if p.get("paused_at") is not None:
            state = "archived" if p.get("archived_at") is not None else "paused"
            open_rounds = f"{open_rounds} ({state})" if p.get("open_rounds") else f"none ({state})"
        recent = p.get("recent_rounds") or []
        last = f"#{recent[0]['id']} {outcome(recent[0])}" if recent else "-"
        lines.append(
            f"{p['name']:<24} {p['current_version']:>7} {p['training_rounds_committed']:>9}  "
            f"{open_rounds:<22} {last}"
        )
    return "\n".join(lines)


def privacy(view: Mapping[str, Any] | None) -> str:
    if view is None:
        return "privacy: no differential privacy"
    epsilon = "no guarantee (no noise)" if view["epsilon"] is None else f"epsilon {view['epsilon']:.3g}"
    budget = view.get("epsilon_budget")
    spent = f"{epsilon} of a budget of {budget:g}" if budget is not None else f"{epsilon} (no budget)"
    within = view.get("rounds_within_budget")
    rounds = f"; {view['training_rounds']} of {within} rounds within budget" if within is not None else ""
    state = " -- budget spent, no more training rounds" if view.get("budget_spent") else ""
    return f"privacy: {spent} at delta {view['delta']:g}{rounds}{state}"


def population(p: Mapping[str, Any], rounds: Sequence[Mapping[str, Any]], now: float) -> str:
    lines = [
        f"population {p['name']}: model {p['artifact_sha256'][:12]}..., version {p['current_version']}, "
        f"{p['training_rounds_committed']} training rounds committed",
    ]
    if p.get("archived_at") is not None:
        lines.append(f"archived since {when(p['archived_at'])}: paused for good")
    elif p.get("paused_at") is not None:
        lines.append(f"paused since {when(p['paused_at'])}: no new rounds open")
    if p.get("backing_off"):
        lines.append(f"backing off: {p['backing_off']}")
    buffered = p.get("settings", {}).get("rounds") == "buffered"
    for r in p.get("open_rounds", []):
        fill = ""
        if buffered and r["kind"] == "training":
            fill = f", buffer {r.get('counters', {}).get('reported', 0)}/{r['target']} reports"
        lines.append(
            f"open: {r['kind']} round #{r['id']} on version {r['base_version']}{fill}, deadline "
            f"{when(r['deadline'])} (in {duration(max(r['deadline'] - now, 0.0))})"
        )
    if p.get("buffer") is not None:
        lines.extend(buffer(p["buffer"], now))
    lines.append(privacy(p.get("privacy")))
    lines.append(model_versions(p))
    lines.append(devices_seen(p.get("devices_seen"), now))
    lines.append("settings: " + json.dumps(p.get("settings", {}), sort_keys=True))
    lines.append(f"rounds (newest first, {len(rounds)}):" if rounds else "rounds: none yet")
    lines.extend("  " + round_line(r, now).replace("\n", "\n  ") for r in rounds)
    return "\n".join(lines)


def buffer(b: Mapping[str, Any], now: float) -> list[str]:
    """A buffered population's figures (BufferView): the open buffer, the staleness of the reports
    counted in the window, what the finished participations came to, versions per hour."""
    if b.get("open_round_id") is None:
        fill = "buffer: none open"
    else:
        fill = (
            f"buffer: #{b['open_round_id']} {b['open_reports']}/{b['buffer_size']} reports, open for "
            f"{duration(max(now - b['open_since'], 0.0))}"
        )
    counts = b.get("staleness_counts") or []
    window = f"the newest {b.get('window_versions', 0)} committed buffers and the open one"
    if sum(counts):
        by = ", ".join(f"{s}: {n}" for s, n in enumerate(counts) if n)
        mean = sum(s * n for s, n in enumerate(counts)) / sum(counts)
        stale = f"staleness ({window}): mean {mean:.2f} versions; reports by staleness {by}"
    else:
        stale = f"staleness ({window}): no report counted"
    finished = sum(b.get(k, 0) for k in ("counted", "refused_stale", "expired", "invalid"))
    if finished:
        counted = f"counted {b['counted']} ({100 * b['counted'] / finished:.0f}%)"
        share = (
            f"finished participations: {finished}, {counted}, "
            f"refused as too stale {b['refused_stale']}, dropped at their deadline {b['expired']}, "
            f"invalid or aborted {b['invalid']}"
        )
    else:
        share = "finished participations: none (idle)"
    hourly = b.get("versions_per_hour") or []
    last = hourly[-1] if hourly else 0
    versions = f"versions committed: {last} this hour, {sum(hourly)} in the last {len(hourly)} h"
    return [fill, stale, share, versions]


SHOWN_VERSIONS = 5


def model_versions(p: Mapping[str, Any]) -> str:
    """The current version and the newest versions kept, with the round that made each."""
    kept = p.get("model_versions") or []
    shown = ", ".join(
        f"{v['version']} ({'export' if v.get('round_id') is None else 'round #' + str(v['round_id'])}, "
        f"{when(v['created_at'])})"
        for v in kept[:SHOWN_VERSIONS]
    )
    more = f" and {len(kept) - SHOWN_VERSIONS} older" if len(kept) > SHOWN_VERSIONS else ""
    return f"model versions: current {p['current_version']}; kept: {shown or 'none'}{more}"


def devices_seen(seen: Mapping[str, Any] | None, now: float) -> str:
    if not seen or not seen.get("total"):
        return "devices seen: none yet"
    last = seen.get("last_seen_at")
    ago = f", last {duration(max(now - last, 0.0))} ago" if last is not None else ""
    return f"devices seen: {seen['total']} in all, {seen.get('last_day', 0)} in the last 24 h{ago}"


def evaluation(round_: Mapping[str, Any], name: str) -> str:
    return (
        f"opened evaluation round #{round_['id']} of {name} on version {round_['base_version']}: "
        f"{round_['target']} reports wanted by {when(round_['deadline'])}"
    )


def pause_state(p: Mapping[str, Any], now: float) -> str:
    open_rounds = ", ".join(f"{r['kind']} #{r['id']}" for r in p.get("open_rounds", []))
    finishing = f"; open rounds run to their end: {open_rounds}" if open_rounds else ""
    if p.get("archived_at") is not None:
        return f"{p['name']} archived since {when(p['archived_at'])}: no new rounds open, for good{finishing}"
    if p.get("paused_at") is not None:
        return f"{p['name']} paused since {when(p['paused_at'])}: no new rounds open{finishing}"
    return f"{p['name']} running; open rounds: {open_rounds or 'none'}"


def settings_changed(p: Mapping[str, Any], asked: Mapping[str, Any]) -> str:
    values = ", ".join(f"{k}={json.dumps(p['settings'][k])}" for k in asked)
    return f"{p['name']} settings version {p['settings_version']}: {values} (from the next round on)"


def settings_history(changes: Sequence[Mapping[str, Any]]) -> str:
    if not changes:
        return "no settings changes since creation"
    return "\n".join(
        f"version {c['version']} {when(c['changed_at'])} by {c['changed_by']}: "
        + ", ".join(
            f"{k} {json.dumps(c['previous'].get(k))} -> {json.dumps(v)}" for k, v in c["changes"].items()
        )
        for c in changes
    )


def download(written: Mapping[str, Any]) -> str:
    files = ", ".join(f"{name} ({size} bytes)" for name, size in written["files"].items())
    return f"version {written['version']} of {written['population']} in {written['folder']}: {files}"
