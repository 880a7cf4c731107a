"""The planner's cost model: what a microbatch costs a rank, for placement and the plan report.

    cm = CostModel.load("cost.json")          # written by `harts calibrate`; CostModel() = rows
    cm.cost(rows, attention, calls, logprob_rows)

A cost is linear in computed rows, attended (query, key) pairs, sequential linear-attention calls
and distinct log-prob rows, with non-negative coefficients; `transfer_byte` prices the bytes of
windows across ranks. The features, the fit and the file format (`FORMAT`): docs/design/planner.md,
"The cost model".
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "harts.cost_model.v1"
#: the feature names, in the order of `features` columns and the JSON coefficients.
FEATURES = ("row", "attention", "linear_call", "logprob_row")

#: Default cost of one transferred byte in computed rows. A row of the default model
#: (Qwen3-Next-80B-A3B, ~3B active parameters: ~1.8e10 FLOP forward and backward) takes ~45 us on
#: an H200 at ~40% of its 989 TFLOP/s; a 200 Gb/s link per GPU (the middle of the usual 100-400
#: Gb/s InfiniBand or RoCE) moves a byte in 0.04 ns: 0.04 ns / 45 us = 8.9e-7 rows, rounded up.
DEFAULT_TRANSFER_ROWS_PER_BYTE = 1e-6


@dataclass(slots=True, kw_only=True, frozen=True)
class CostModel:
    """Coefficients of the linear microbatch cost (docs/design/planner.md, "The cost model")."""

    row: float = 1.0
    """Cost per computed row."""
    attention: float = 0.0
    """Cost per attended (query, key) pair."""
    linear_call: float = 0.0
    """Cost per sequential linear-attention call of a microbatch."""
    logprob_row: float = 0.0
    """Cost per distinct log-prob row (lm head and loss)."""
    transfer_byte: float | None = None
    """Cost of one byte a window across ranks sends (plan.proto CostModel.transfer_byte; seconds
    per byte when measured); None (not measured): row x DEFAULT_TRANSFER_ROWS_PER_BYTE."""
    source: str = "rows"
    """Where the coefficients come from (reports)."""
    fit: dict = field(default_factory=dict, compare=False, hash=False)
    """The calibration report (R^2, max relative error, samples), if fitted."""

    def __post_init__(self) -> None:
        for name in FEATURES:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"cost model {name}: expected a finite coefficient >= 0, got {v!r}")
        if self.row + self.attention + self.linear_call + self.logprob_row <= 0:
            raise ValueError("cost model: expected a coefficient > 0 (a cost that grows with the work), got all 0")
        if self.transfer_byte is None:
            object.__setattr__(self, "transfer_byte", self.row * DEFAULT_TRANSFER_ROWS_PER_BYTE)
        v = self.transfer_byte
        if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"cost model transfer_byte: expected a finite cost >= 0 per byte, got {v!r}")

    @property
    def coefficients(self) -> np.ndarray:
        """float64 [4] in FEATURES order."""
        return np.array([getattr(self, n) for n in FEATURES], np.float64)

    def cost(self, rows, attention, calls, logprob_rows):
        """Cost of microbatches with these features (scalars or arrays)."""
        return self.row * rows + self.attention * attention + self.linear_call * calls + self.logprob_row * logprob_rows

    def path_cost(self, length):
        """Cost of one trajectory of `length` tokens computed alone (one call, no log-prob term):
        a lower bound on the rank that computes its last token (it computes all its rows)."""
        length = np.asarray(length, np.float64)
        return self.row * length + self.attention * length * (length + 1) / 2 + self.linear_call * (length > 0)

    def fill(self, msg, *, transfer: bool = False) -> None:
        """Write the coefficients into a `plan_pb2.CostModel`; `transfer_byte` only with `transfer`
        (plans that may carry windows across ranks; 0 in the others)."""
        for name in FEATURES:
            setattr(msg, name, float(getattr(self, name)))
        if transfer:
            msg.transfer_byte = float(self.transfer_byte)
        msg.source = self.source

    def to_dict(self) -> dict:
        return {"format": FORMAT, "coefficients": {n: float(getattr(self, n)) for n in FEATURES},
                "transfer_byte": float(self.transfer_byte), "source": self.source, "fit": self.fit}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """Raises ValueError naming the offending key."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"cost model format: expected {FORMAT!r}, got {got!r}")
        coef = d.get("coefficients")
        if not isinstance(coef, dict):
            raise ValueError("cost model coefficients: expected an object of the four coefficients")
        unknown = sorted(set(coef) - set(FEATURES))
        if unknown:
            raise ValueError(f"cost model coefficients: expected keys from {', '.join(FEATURES)}, got {', '.join(unknown)}")
        vals = {n: _number(coef.get(n, 0.0), n) for n in FEATURES}
        transfer = d.get("transfer_byte")
        fit = d.get("fit") or {}
        return cls(**vals, transfer_byte=None if transfer is None else _number(transfer, "transfer_byte"),
                   source=str(d.get("source", "file")), fit=fit if isinstance(fit, dict) else {})

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"cost model: expected a JSON document, got invalid JSON ({exc})") from None
        return cls.from_dict(d)

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        return cls.from_json(Path(path).read_text())


def microbatch_features(num_rows: int, replay_rows: int, depth_R: np.ndarray, replay_depth: np.ndarray,
                        num_calls: int, lp_row_P: np.ndarray) -> np.ndarray:
    """float64 [4] features of one microbatch (FEATURES order).

    Args:
        depth_R: int [R] depth of every local row; replay_depth: int [n] depth of every replay row.
        lp_row_P: int [P] log-prob rows (duplicates count once).
    """
    attn = float((np.asarray(depth_R, np.int64) + 1).sum()) + float((np.asarray(replay_depth, np.int64) + 1).sum())
    lp = 0
    if len(lp_row_P):
        seen = np.zeros(max(int(num_rows), int(np.max(lp_row_P)) + 1), np.bool_)
        seen[np.asarray(lp_row_P)] = True
        lp = int(seen.sum())
    return np.array([num_rows + replay_rows, attn, num_calls, lp], np.float64)


def nnls(A: np.ndarray, b: np.ndarray, *, max_iter: int = 200) -> np.ndarray:
    """Non-negative least squares min ||A x - b|| s.t. x >= 0 (Lawson-Hanson active set).

    Args:
        A: float64 [n, k]; b: float64 [n].
    Returns:
        x float64 [k].
    """
    A = np.asarray(A, np.float64)
    b = np.asarray(b, np.float64)
    n, k = A.shape
    x = np.zeros(k)
    passive = np.zeros(k, np.bool_)
    tol = 10 * np.finfo(np.float64).eps * np.linalg.norm(A, 1) * max(n, k)
    for _ in range(max_iter):
        w = A.T @ (b - A @ x)
        if passive.all() or (w[~passive] <= tol).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(k)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


def _number(v, name: str) -> float:
    """A JSON number as a float; ValueError naming the key for anything else, an integer beyond
    float64 included (the finite, non-negative checks are CostModel's)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        shown = repr(v)
        raise ValueError(f"cost model {name}: expected a number, got {shown if len(shown) <= 80 else shown[:77] + '...'}")
    try:
        return float(v)
    except OverflowError:
        raise ValueError(f"cost model {name}: expected a finite coefficient >= 0, got an integer beyond float64") from None
