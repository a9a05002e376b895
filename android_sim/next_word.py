"""The next-word prediction model as the simulator's fleet and benchmark export and measure it.

One builder (`model_export.models.next_word:build`), exported in another process with its
sizes as keyword arguments; the federation's defaults (task and server optimizer); and the
paper's Table 2 figures from the evaluation's token counts, which add up across devices.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping
from pathlib import Path

from android_sim.shakespeare import Vocabulary
from contracts.manifest import Manifest, ManifestError, load_manifest
from contracts.task_config import TaskConfig
from model_export.in_subprocess import export_spec_in_subprocess
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig

BUILDER = "model_export.models.next_word:build"
SEQ_LEN, BATCH_SIZE, MAX_BATCHES = 20, 8, 8
# A role needs this many windows to be a device (the data protocol: too little text to split).
MIN_ROLE_EXAMPLES = 10

SERVER = ServerOptimizerConfig("adam", 0.01)  # as the paper's adaptive server optimizers
TASK = TaskConfig(
    reconstruction_learning_rate=0.5,
    reconstruction_max_epochs=2,
    update_learning_rate=0.3,
    update_max_epochs=1,
)

ModelArgs = Mapping[str, int | float | bool | str]
_ARGS_FILE = "model_args.json"


def model_args(
    vocabulary: Vocabulary, seq_len: int, **more: int | float | bool | str
) -> dict[str, int | float | bool | str]:
    """The builder's arguments for `vocabulary` (its tables: PAD, BOS, EOS, the words, then the
    OOV buckets) and windows of `seq_len`; `more` are further builder arguments."""
    return {
        "num_global_tokens": vocabulary.num_global_tokens,
        "num_oov_buckets": vocabulary.num_oov_buckets,
        "seq_len": seq_len,
        "batch_size": BATCH_SIZE,
        "max_batches": MAX_BATCHES,
        **more,
    }


def export(out: Path, args: ModelArgs) -> Path:
    """The model exported into `out` with the builder's `args`, unless `out` already holds an
    export of exactly these arguments."""
    recorded = out / _ARGS_FILE
    wanted = {"builder": BUILDER, "args": dict(args)}
    if recorded.is_file() and json.loads(recorded.read_text()) == wanted:
        with contextlib.suppress(ManifestError, OSError):
            load_manifest(out)
            return out
    recorded.unlink(missing_ok=True)
    export_spec_in_subprocess(BUILDER, out, args)
    recorded.write_text(json.dumps(wanted))  # written last: an interrupted export is not reused
    return out


def accuracies(sums: Mapping[str, float]) -> tuple[float, float]:
    """(without OOV, with OOV) from the evaluation's summed token counts (NaN without tokens):
    without OOV, OOV targets do not count and predicting a bucket is wrong; with OOV, predicting
    the target's bucket is right (`model_export.models.next_word.example_metrics`)."""

    def ratio(correct: str, total: str) -> float:
        return sums.get(correct, 0.0) / sums[total] if sums.get(total, 0.0) > 0 else math.nan

    return (
        ratio("correct_in_vocab_tokens_sum", "in_vocab_tokens_sum"),
        ratio("correct_tokens_sum", "tokens_sum"),
    )


def parameter_bytes_per_round(manifest: Manifest, shared_locals: bool = False) -> int:
    """A device's download of the shared parameters plus the upload of their delta, float32 and
    dense; the locals too when the server shares them (FedAvg over every variable)."""
    shared = (*manifest.global_params, *(manifest.local_params if shared_locals else ()))
    return 2 * sum(4 * math.prod(s.shape) for s in shared)
