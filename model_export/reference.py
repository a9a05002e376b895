"""A numpy reference of the exported model's maths, for tests.

Deliberately written differently from `model.py`: dense parameters indexed by global item
id, hand-derived gradients, one plain loop per step, float64. If the TFLite signatures
agree with this, the compact per-task tables, the padding and the autodiff are right.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

Batch = tuple[np.ndarray, np.ndarray, np.ndarray]  # item ids, labels, weights; one batch


@dataclass
class ReferenceModel:
    feedback: str  # "explicit" | "implicit"
    global_params: dict[str, np.ndarray]
    local_params: dict[str, np.ndarray] = field(default_factory=dict)
    huber_delta: float = 0.0  # explicit feedback: 0 is squared error
    # Explicit feedback: the rating scale `evaluate` clips predictions to, or None (unclipped).
    prediction_range: tuple[float, float] | None = None
    # Each item's group, when the model has `group_embeddings` / `group_bias` (dense, by group).
    item_groups: np.ndarray | None = None
    group_rate: float = 1.0  # the group tables' values are sqrt(group_rate) times the stored ones
    # > 0: `reconstruct` starts the user vector at this times the label-weighted mean of the
    # batches' item vectors (`history_start_groups`: their groups' embeddings alone).
    history_start: float = 0.0
    history_start_groups: bool = False
    history_start_contrast: bool = False  # minus the mean of the other examples' vectors

    def __post_init__(self) -> None:
        self.global_params = {k: np.asarray(v, np.float64).copy() for k, v in self.global_params.items()}
        self.local_params = {k: np.asarray(v, np.float64).copy() for k, v in self.local_params.items()}

    # ---- forward -----------------------------------------------------------------------

    def scores(self, items: np.ndarray) -> np.ndarray:
        g, loc = self.global_params, self.local_params
        out = self._item_vectors(items) @ loc["user_embedding"]
        if "item_bias" in g:
            out = out + g["item_bias"][items]
        if "group_bias" in g:
            out = out + self._group_scale * g["group_bias"][self._groups(items)]
        if "user_bias" in loc:
            out = out + loc["user_bias"][0]
        if "global_mean" in g:
            out = out + g["global_mean"][0]
        return np.asarray(out)

    @property
    def _group_scale(self) -> float:
        return float(np.sqrt(self.group_rate))

    def _groups(self, items: np.ndarray) -> np.ndarray:
        assert self.item_groups is not None, "a model with group tables needs item_groups"
        return np.asarray(np.asarray(self.item_groups)[items])

    def _item_vectors(self, items: np.ndarray) -> np.ndarray:
        """Each item's embedding, plus its group's if the model has group embeddings."""
        rows = self.global_params["item_embeddings"][items]
        if "group_embeddings" in self.global_params:
            rows = rows + self._group_scale * self.global_params["group_embeddings"][self._groups(items)]
        return np.asarray(rows)

    def example_losses(self, scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
        if self.feedback == "explicit":
            error = scores - labels
            d = self.huber_delta
            if d > 0:
                return np.asarray(np.where(np.abs(error) <= d, error**2, 2 * d * np.abs(error) - d * d))
            return np.asarray(error**2)
        # numerically stable logistic loss
        return np.asarray(np.maximum(scores, 0) - scores * labels + np.log1p(np.exp(-np.abs(scores))))

    def _dloss_dscore(self, scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
        if self.feedback == "explicit":
            error = scores - labels
            if self.huber_delta > 0:
                error = np.clip(error, -self.huber_delta, self.huber_delta)
            return np.asarray(2.0 * error)
        return np.asarray(1.0 / (1.0 + np.exp(-scores)) - labels)

    # ---- one batch ---------------------------------------------------------------------

    def batch_gradients(
        self, batch: Batch, l2_global: float, l2_local: float
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], float]:
        """Gradients of the batch objective w.r.t. all global and local params, and its data loss."""
        items, labels, weights = batch
        g, loc = self.global_params, self.local_params
        total = float(weights.sum())
        grads_g = {k: np.zeros_like(v) for k, v in g.items()}
        grads_l = {k: np.zeros_like(v) for k, v in loc.items()}
        if total <= 0.0:
            return grads_g, grads_l, 0.0
        s = self.scores(items)
        data_loss = float((weights * self.example_losses(s, labels)).sum() / total)
        d_score = weights * self._dloss_dscore(s, labels) / total
        rows = g["item_embeddings"][items]
        grads_l["user_embedding"] = d_score @ self._item_vectors(items) + 2 * l2_local * loc["user_embedding"]
        if "user_bias" in loc:
            grads_l["user_bias"] = np.array([d_score.sum()]) + 2 * l2_local * loc["user_bias"]
        item_grad = (
            np.outer(d_score, loc["user_embedding"]) + 2 * l2_global * (weights / total)[:, None] * rows
        )
        np.add.at(grads_g["item_embeddings"], items, item_grad)
        if "item_bias" in g:
            bias_grad = d_score + 2 * l2_global * (weights / total) * g["item_bias"][items]
            np.add.at(grads_g["item_bias"], items, bias_grad)
        # The group tables are dense globals: no L2 (it applies to the rows a task uses).
        if "group_embeddings" in g:
            np.add.at(
                grads_g["group_embeddings"],
                self._groups(items),
                self._group_scale * np.outer(d_score, loc["user_embedding"]),
            )
        if "group_bias" in g:
            np.add.at(grads_g["group_bias"], self._groups(items), self._group_scale * d_score)
        if "global_mean" in g:
            grads_g["global_mean"] = np.array([d_score.sum()])
        return grads_g, grads_l, data_loss

    # ---- the signatures ----------------------------------------------------------------

    def reset_local(self) -> None:
        self.local_params = {k: np.zeros_like(v) for k, v in self.local_params.items()}

    def reconstruct(
        self, batches: list[Batch], num_steps: int, learning_rate: float, l2_local: float
    ) -> float:
        """SGD on the local params only, cycling over `batches`; returns the mean data loss."""
        if self.history_start > 0:
            self._start_from_history(batches)
        losses = []
        for step in range(num_steps if batches else 0):
            _, grads_l, loss = self.batch_gradients(batches[step % len(batches)], 0.0, l2_local)
            for k in self.local_params:
                self.local_params[k] = self.local_params[k] - learning_rate * grads_l[k]
            losses.append(loss)
        return float(np.mean(losses)) if losses else 0.0

    def _start_from_history(self, batches: list[Batch]) -> None:
        """The user vector at `history_start` x the mean of the shares' vectors, if any."""

        def mean(share: float) -> tuple[np.ndarray, float]:
            weighted = [
                (items, weights * (labels if share else 1.0 - labels)) for items, labels, weights in batches
            ]
            total = sum(float(w.sum()) for _, w in weighted)
            vectors = sum(w @ self._start_vectors(items) for items, w in weighted)
            return (np.asarray(vectors) / total if total > 0 else np.zeros(0)), total

        shared, total = mean(1.0)
        if total <= 0:
            return
        if self.history_start_contrast:
            others, rest = mean(0.0)
            if rest > 0:
                shared = shared - others
        self.local_params["user_embedding"] = self.history_start * shared

    def _start_vectors(self, items: np.ndarray) -> np.ndarray:
        if self.history_start_groups:
            groups = self.global_params["group_embeddings"][self._groups(items)]
            return np.asarray(self._group_scale * groups)
        return self._item_vectors(items)

    def update(
        self,
        batches: list[Batch],
        num_steps: int,
        learning_rate: float,
        local_learning_rate: float = 0.0,
        l2_global: float = 0.0,
        l2_local: float = 0.0,
        central_gradient: dict[str, np.ndarray] | None = None,
        central_gradient_weight: float = 0.0,
    ) -> tuple[dict[str, np.ndarray], float]:
        """SGD on the globals (and locals if `local_learning_rate` > 0); returns (delta, mean loss).

        Every step adds `central_gradient_weight` times `central_gradient` (dense, by global) to
        the globals' gradient. The model's globals are left unchanged, as the signature leaves them.
        """
        central = central_gradient or {}
        start = {k: v.copy() for k, v in self.global_params.items()}
        losses = []
        for step in range(num_steps if batches else 0):
            grads_g, grads_l, loss = self.batch_gradients(batches[step % len(batches)], l2_global, l2_local)
            for k in self.global_params:
                g = grads_g[k] + central_gradient_weight * central.get(k, 0.0)
                self.global_params[k] = self.global_params[k] - learning_rate * g
            for k in self.local_params:
                self.local_params[k] = self.local_params[k] - local_learning_rate * grads_l[k]
            losses.append(loss)
        delta = {k: self.global_params[k] - start[k] for k in start}
        self.global_params = start
        return delta, float(np.mean(losses)) if losses else 0.0

    def gradient(self, batches: list[Batch]) -> tuple[dict[str, np.ndarray], float]:
        """The gradient of the example-weighted mean data loss over all `batches` (dense, by
        global) and that loss: each batch's mean-loss gradient weighted by its share of examples."""
        total = sum(float(w.sum()) for _, _, w in batches)
        grads = {k: np.zeros_like(v) for k, v in self.global_params.items()}
        loss = 0.0
        for batch in batches:
            share = float(batch[2].sum()) / total if total > 0 else 0.0
            grads_g, _, batch_loss = self.batch_gradients(batch, 0.0, 0.0)
            for k in grads:
                grads[k] += share * grads_g[k]
            loss += share * batch_loss
        return grads, loss

    def evaluate(self, batches: list[Batch]) -> dict[str, float]:
        sums = {"loss_sum": 0.0, "squared_error_sum": 0.0, "correct_sum": 0.0, "weight_sum": 0.0}
        for items, labels, weights in batches:
            s = self.scores(items)
            if self.feedback == "explicit":
                rating = s if self.prediction_range is None else np.clip(s, *self.prediction_range)
                correct = np.abs(rating - labels) <= 0.5
                squared = (rating - labels) ** 2
            else:
                correct = (s > 0).astype(np.float64) == labels
                squared = (1 / (1 + np.exp(-s)) - labels) ** 2
            sums["loss_sum"] += float((weights * self.example_losses(s, labels)).sum())
            sums["squared_error_sum"] += float((weights * squared).sum())
            sums["correct_sum"] += float((weights * correct).sum())
            sums["weight_sum"] += float(weights.sum())
        return sums

    def all_scores(self) -> np.ndarray:
        return self.scores(np.arange(self.global_params["item_embeddings"].shape[0]))
