"""A DP-SGD history kept by a training loop elsewhere (Opacus's accountant, or any DP-SGD), read
into the ``TrainingRecord`` our accountants interpret (``privfusion pool add``).

The file (JSON; ``docs/pool_add.md`` is the user's page)::

    {"format": 1, "kind": "dpsgd-history",
     "history": [[noise_multiplier, sample_rate, steps], ...],   # Opacus: accountant.history
     "clip_norm": C,                  # Opacus: optimizer.max_grad_norm (one number: flat clipping)
     "adjacency": "add-remove",       # or "replace-one": the unit of privacy it was run for
     "dataset_size": n,               # the declared n; with Poisson sampling the expected batch is q·n
     "sampling": "poisson",           # how batches were drawn (required when some q < 1)
     "learning_rate": eta,            # declared; changes no ε (LC's surrogate reads it)
     "optimizer": {"name": "sgd"},    # optional, as in a TrainingRecord (post-processing)
     "source": "opacus 1.6.0"}        # optional, free text (who trained it)

Each history segment (σ, q, k) is k steps of the Gaussian mechanism on the clipped gradient sum
(noise std σ·C, L2 sensitivity C add-remove, 2C replace-one) on a Poisson sample of rate q (q = 1:
every record). That is the mechanism Opacus's ``PrivacyEngine.make_private`` runs with
``poisson_sampling=True`` (its default) and whose steps its accountants record: ``RDPAccountant``
and ``PRVAccountant`` keep exactly this list, merging consecutive equal steps. With
``poisson_sampling=False`` (shuffled fixed-size batches) Opacus still records the Poisson rate,
but a Poisson accountant's figure does not hold for shuffling; so a history whose rate is below
1 must say ``"sampling": "poisson"``, and any other sampling is refused: we cannot check how the
batches were drawn, and charge only what the declaration lets us prove.

What cannot be accounted is refused, naming the field: a missing or non-numeric noise multiplier
(``history[2].noise_multiplier``), σ = 0 (a step without noise has no finite guarantee), a rate
outside (0, 1], a step count that is not a positive integer, a missing or per-layer clip norm
(``clip_norm``), an adjacency or dataset size not given, an unknown field. Everything here is
a declaration of the site that adds the model: the record says so (``trained_elsewhere``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from peer.base.errors import InvalidArgument
from peer.dp.accounting import TrainingRecord
from peer.dp.accounting.training_records import GaussianStep, Optimizer, check_adjacency

FORMAT = 1
KIND = "dpsgd-history"
REQUIRED = ("history", "clip_norm", "adjacency", "dataset_size", "learning_rate")
FIELDS = frozenset({"format", "kind", *REQUIRED, "sampling", "optimizer", "source"})
SAMPLINGS = ("poisson",)


@dataclass(frozen=True)
class DeclaredHistory:
    """A history read and checked: the training record, the declared dataset size, and what was
    declared about it (source, sampling) for the model's record."""

    training: TrainingRecord
    dataset_size: int
    declared: dict


def _positive(value: Any, where: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(where, f"must be {what}, got {_kind_of(value)}")
    if not value > 0:
        raise InvalidArgument(where, f"must be {what} > 0, got {value!r}")
    return float(value)


def _kind_of(value: Any) -> str:
    if value is None:
        return "null (unknown)"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    return f"a {type(value).__name__}"


def _segment(raw: Any, i: int) -> tuple[float, float, int]:
    where = f"history[{i}]"
    if isinstance(raw, Mapping):
        unknown = sorted(set(raw) - {"noise_multiplier", "sample_rate", "steps"})
        if unknown:
            raise InvalidArgument(where, f"unknown fields {unknown}")
        values = [raw.get(k) for k in ("noise_multiplier", "sample_rate", "steps")]
    elif isinstance(raw, (list, tuple)) and len(raw) == 3:
        values = list(raw)
    else:
        raise InvalidArgument(
            where, "must be [noise_multiplier, sample_rate, steps] (an entry of Opacus's accountant.history)"
        )
    sigma, q, steps = values
    if sigma is None or isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not math.isfinite(sigma):
        raise InvalidArgument(
            f"{where}.noise_multiplier",
            f"is {_kind_of(sigma)}: the noise of these steps is unknown, so they cannot be accounted",
        )
    if not sigma > 0:
        raise InvalidArgument(
            f"{where}.noise_multiplier", f"is {sigma!r}: steps without noise have no finite guarantee"
        )
    if q is None or isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 1:
        raise InvalidArgument(f"{where}.sample_rate", f"must be a Poisson sample rate in (0, 1], got {_kind_of(q)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        raise InvalidArgument(f"{where}.steps", f"must be a positive integer, got {_kind_of(steps)}")
    return float(sigma), float(q), int(steps)


def read_history(data: Any) -> DeclaredHistory:
    """Check a history file's JSON value and build its ``TrainingRecord`` (module docstring)."""
    if not isinstance(data, Mapping):
        raise InvalidArgument("history file", "must be a JSON object (docs/pool_add.md)")
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise InvalidArgument("history file", f"unknown fields {unknown}; the fields are {sorted(FIELDS)}")
    if data.get("format", FORMAT) != FORMAT:
        raise InvalidArgument("format", f"must be {FORMAT}, got {data.get('format')!r}")
    if data.get("kind", KIND) != KIND:
        raise InvalidArgument("kind", f"must be {KIND!r}, got {data.get('kind')!r}")
    for key in REQUIRED:
        if key not in data or data[key] is None:
            hint = {
                "clip_norm": " (Opacus: optimizer.max_grad_norm): without it the sensitivity is unknown",
                "adjacency": " ('add-remove', what Opacus's accountants assume, or 'replace-one')",
                "dataset_size": " (the declared n: the dataset's size, len(train_dataset) for Opacus)",
                "learning_rate": " (the optimiser's learning rate; it changes no epsilon)",
                "history": " (Opacus: privacy_engine.accountant.history)",
            }[key]
            raise InvalidArgument(key, f"is required{hint}")
    clip = data["clip_norm"]
    if isinstance(clip, (list, tuple)):
        raise InvalidArgument(
            "clip_norm",
            "is a list (per-layer clipping): give the flat clip norm; per-layer thresholds are not accounted here",
        )
    clip = _positive(clip, "clip_norm", "a number")
    adjacency = check_adjacency(data["adjacency"])
    n = data["dataset_size"]
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise InvalidArgument("dataset_size", f"must be a positive integer, got {_kind_of(n)}")
    lr = _positive(data["learning_rate"], "learning_rate", "a number")
    raw = data["history"]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise InvalidArgument("history", "must be a non-empty list of [noise_multiplier, sample_rate, steps]")
    segments = [_segment(s, i) for i, s in enumerate(raw)]
    sampling = data.get("sampling")
    subsampled = any(q < 1 for _, q, _ in segments)
    if sampling is not None and sampling not in SAMPLINGS:
        raise InvalidArgument(
            "sampling",
            f"is {sampling!r}; only Poisson sampling is accounted (Opacus: poisson_sampling=True, its default): "
            "a Poisson accountant's figure does not hold for shuffled or fixed-size batches",
        )
    if subsampled and sampling is None:
        raise InvalidArgument(
            "sampling",
            'is required when a sample rate is below 1: declare "poisson" (Opacus with poisson_sampling=True); '
            "other samplings are not accounted",
        )
    optimizer = Optimizer()
    if "optimizer" in data:
        optimizer = Optimizer.from_dict(data["optimizer"])
    source = data.get("source")
    if source is not None and not isinstance(source, str):
        raise InvalidArgument("source", f"must be text, got {_kind_of(source)}")
    runs = [(GaussianStep(lr, clip, sigma, q), steps) for sigma, q, steps in segments]
    training = TrainingRecord.from_runs(adjacency, runs, optimizer=optimizer)
    declared = {
        "source": source or "not given",
        "sampling": sampling or "full batch",
        "segments": [[sigma, q, steps] for sigma, q, steps in segments],
        "declared_by": "the site that added the model (its history file); the noise was drawn by the trainer",
    }
    return DeclaredHistory(training, n, declared)
