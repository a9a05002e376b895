"""Where the main job's gap to the Bayes ceiling lies: what the ceiling needs to know, and what a
posterior predictive on FedRecon's own tables does.

    .venv/bin/python -m benchmarks.bayes_gap [SETTINGS_JSON]

SETTINGS_JSON is one `benchmarks.main_quality` configuration (default `{"validation": true}`:
150 validation devices kept out of training). After its training and serving, on the same
devices, each line is a top-10 rule's expected hit rate@10 and its paired differences from
FedRecon and from the Bayes ceiling, over every device and per history size (1 / 2-4 / 5+):
- a user vector fitted to each device's true share probabilities on FedRecon's tables (what the
  globals allow a perfectly known user);
- softmax MAP user vectors (the generator's likelihood over the whole catalog, ridge `lam`);
- a posterior predictive on FedRecon's tables: an empirical prior (the training devices' softmax
  MAP vectors, those with at least `min_n` shares, jittered), importance-weighted by the history;
- the Bayes ceiling with part of the generator's truth replaced by what a learner could know:
  the popularity by the training devices' share frequencies, or by FedRecon's item and topic
  biases; the item vectors by their topic's centroid.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from android_sim.bayes_ceiling import bayes_ceiling
from android_sim.expressions import ExpressionCatalog, SyntheticExpressions
from android_sim.hit_rates import expected_hit_rate, history_bucket
from android_sim.recommendations import training_shares
from benchmarks.main_quality import paired_text, run

DRAWS = 20_000  # the empirical prior's draws a device's posterior is weighted over
# (min_n, lam, jitter): the prior's devices, their MAP's ridge, the jitter in units of the pool's spread
PRIORS = ((10, 0.05, 0.3), (10, 0.05, 0.6), (20, 0.05, 0.3), (5, 0.2, 0.5))


def softmax_rows(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return np.asarray(e / e.sum(axis=1, keepdims=True))


def log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    return np.asarray(z - np.log(np.exp(z).sum(axis=1, keepdims=True)))


def fit(counts: np.ndarray, items: np.ndarray, bias: np.ndarray, lam: float, steps: int = 300) -> np.ndarray:
    """Each row of `counts`' softmax MAP user vector under ridge `lam`, by gradient descent."""
    users = np.zeros((len(counts), items.shape[1]))
    n = counts.sum(1, keepdims=True)
    for _ in range(steps):
        p = softmax_rows(users @ items.T + bias)
        users -= 0.5 * ((p * n - counts) @ items + 2 * lam * users) / np.maximum(n, 1)
    return users


def main() -> None:
    try:
        spec: dict[str, Any] = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {"validation": True}
    except json.JSONDecodeError as e:
        sys.exit(f"bayes_gap: SETTINGS_JSON is not JSON ({e}); expected e.g. '{{\"validation\": true}}'")
    if not isinstance(spec, dict):
        sys.exit("bayes_gap: SETTINGS_JSON must be a JSON object of main_quality's keys")
    with tempfile.TemporaryDirectory() as work:
        trained: dict[str, Any] = {}
        found = run(spec, Path(work), trained)
    t = next(iter(trained.values()))
    groups = np.asarray(t.model.item_groups, np.int64)
    rate = np.sqrt(t.model.group_rate)  # the stored group tables are scaled (`group_rate`)
    p = {k: np.asarray(v, np.float64) for k, v in t.params.items()}
    items = p["item_embeddings"] + rate * p["group_embeddings"][groups]
    bias = p["item_bias"].reshape(-1) + rate * p["group_bias"].reshape(-1)[groups]
    catalog = len(items)
    train_counts = np.stack(
        [np.bincount(training_shares(t.workload, i), minlength=catalog) for i in t.training]
    ).astype(np.float64)
    scored = {d.index: d for d in found.scored}
    held = [i for i in t.held if i in scored]
    history = {i: np.asarray(t.stored[i].examples["item"], np.int64) for i in held}
    counts = np.stack([np.bincount(history[i], minlength=catalog) for i in held]).astype(np.float64)
    truth = np.stack([np.asarray(scored[i].probabilities) for i in held])
    buckets = {i: history_bucket(scored[i].history) for i in held}

    def rates(predictive: np.ndarray) -> dict[int, float]:
        tops = np.argsort(-predictive, axis=1)[:, :10]
        return {i: expected_hit_rate(tops[k], truth[k]) for k, i in enumerate(held)}

    def of(method: str) -> dict[int, float]:
        return {
            i: expected_hit_rate(np.asarray(scored[i].tops[method]), truth[k]) for k, i in enumerate(held)
        }

    fedrecon, bayes = of("personalized"), of("bayes")
    mean = {name: np.mean(list(found.values())) for name, found in (("FedRecon", fedrecon), ("Bayes", bayes))}
    print(f"{json.dumps(spec)}: FedRecon {mean['FedRecon']:.1%}, Bayes {mean['Bayes']:.1%}")

    def report(name: str, mine: dict[int, float]) -> None:
        print(
            f"{name}: {np.mean(list(mine.values())):.1%}; "
            f"minus FedRecon {paired_text(fedrecon, mine, buckets)}; "
            f"minus Bayes {paired_text(bayes, mine, buckets)}",
            flush=True,
        )

    oracle = fit(truth * 1000, items, bias, 1e-3, steps=500)
    report(
        "user vector fitted to the true probabilities, FedRecon's tables",
        rates(softmax_rows(oracle @ items.T + bias)),
    )
    for lam in (0.05, 0.2, 0.5):
        users = fit(counts, items, bias, lam)
        report(f"softmax MAP user vector, ridge {lam}", rates(softmax_rows(users @ items.T + bias)))
    rng = np.random.default_rng(0)
    for min_n, lam, jitter in PRIORS:
        pool = fit(train_counts[train_counts.sum(1) >= min_n], items, bias, lam)
        draws = pool[rng.integers(len(pool), size=DRAWS)]
        draws += jitter * pool.std(0) * rng.normal(size=draws.shape)
        log_p = log_softmax_rows(draws @ items.T + bias).astype(np.float32)
        ll = counts.astype(np.float32) @ log_p.T
        w = np.exp(ll - ll.max(1, keepdims=True))
        w /= w.sum(1, keepdims=True)
        ess = 1 / (w * w).sum(1)
        report(
            f"posterior predictive, prior: {len(pool)} training devices' MAP (>= {min_n} shares, "
            f"ridge {lam}, jitter {jitter}; ESS min {ess.min():.0f}, median {np.median(ess):.0f})",
            rates(w @ np.exp(log_p)),
        )
    data: SyntheticExpressions = t.workload.truth.data
    histories = [history[i] for i in held]
    frequency = train_counts.sum(0) + 0.5
    for name, popularity in (
        ("popularity = the training devices' share frequency", frequency / frequency.sum()),
        (
            "popularity = FedRecon's item + topic biases",
            np.exp(bias - bias.max()) / np.exp(bias - bias.max()).sum(),
        ),
    ):
        known = replace(data, catalog=ExpressionCatalog(data.catalog.expressions, popularity))
        report(f"Bayes with {name}", rates(bayes_ceiling(known, histories).predictive))
    centroids = replace(data, item_vectors=data.topic_centroids[data.item_topics])
    report(
        "Bayes with each item's vector = its topic's centroid",
        rates(bayes_ceiling(centroids, histories).predictive),
    )


if __name__ == "__main__":
    main()
