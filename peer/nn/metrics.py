"""Classification metrics of a model's predicted class probabilities: what ``privfusion
evaluate`` reports and the experiments' Table IV rows use.

scikit-learn, on the predicted class = argmax of the probabilities, per-class scores with
``zero_division=0``: ``accuracy``; ``macro_f1``, ``macro_recall``, ``macro_precision`` (the
unweighted mean over the classes) and ``weighted_f1``, ``weighted_recall``,
``weighted_precision`` (weighted by each class's support) — the metrics of the PrivFusion
paper's Table IV; for a binary label ``auroc`` (the score is the probability of class index 1;
None when the labels hold one class only); and ``confusion_matrix`` (rows: true class, columns:
predicted class). Pure: arrays in, numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from peer.base.errors import InvalidArgument


def classification_metrics(y_true: np.ndarray, proba: np.ndarray, classes: Sequence[Any]) -> dict:
    """The scores of predicted class probabilities ``proba`` (m, K) against labels ``y_true``
    (class indices 0..K−1); the module docstring defines each."""
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_score, recall_score, roc_auc_score

    y_true = np.asarray(y_true, dtype=np.int64)
    proba = np.asarray(proba, dtype=np.float64)
    k = len(classes)
    if proba.ndim != 2 or proba.shape != (len(y_true), k):
        raise InvalidArgument(
            "model",
            f"gives {proba.shape[1] if proba.ndim == 2 else '?'} outputs per record but the "
            f"preprocessing has {k} classes: they do not belong together",
        )
    if len(y_true) == 0:
        raise InvalidArgument("--data", "holds no records")
    y_pred = proba.argmax(axis=1)
    labels = list(range(k))
    out = {
        "records": len(y_true),
        "classes": [c if isinstance(c, (int, str)) else str(c) for c in classes],
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "macro_f1": float(f1_score(y_true, y_pred, labels=labels, average="macro", zero_division=0)),
        "weighted_f1": float(f1_score(y_true, y_pred, labels=labels, average="weighted", zero_division=0)),
        "macro_recall": float(recall_score(y_true, y_pred, labels=labels, average="macro", zero_division=0)),
        "macro_precision": float(precision_score(y_true, y_pred, labels=labels, average="macro", zero_division=0)),
        "weighted_recall": float(recall_score(y_true, y_pred, labels=labels, average="weighted", zero_division=0)),
        "weighted_precision": float(
            precision_score(y_true, y_pred, labels=labels, average="weighted", zero_division=0)
        ),
        "confusion_matrix": confusion_matrix(y_true, y_pred, labels=labels).tolist(),
    }
    if k == 2:
        out["auroc"] = float(roc_auc_score(y_true, proba[:, 1])) if len(np.unique(y_true)) == 2 else None
    return out


__all__ = ["classification_metrics"]
