"""Comparing one runner's outputs with the reference's: error statistics and error by position.

Positions are bucketed by powers of two ([0], [1], [2, 3], [4, 7], ..., [65536, 131071]), so a
report stays readable whether the file's positions span 64 rows or 131072; negative positions
(padding, tested on purpose) have a bucket of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rope_export.op.tolerances import AgainstPyTorch, Tolerance


@dataclass
class OutputStats:
    output: str
    max_abs: float
    mean_abs: float
    max_rel: float
    mean_rel: float
    passed: bool
    problem: str = ""  # why the comparison could not be made (shape or dtype), when it could not
    # against a higher-precision reference: PyTorch's own max abs error in the file's dtype, and the bound it sets
    pytorch_max_abs: float | None = None
    bound: float | None = None

    @property
    def ratio(self) -> float | None:
        """This runner's error over PyTorch's (both against the higher-precision reference)."""
        if self.pytorch_max_abs is None:
            return None
        if self.pytorch_max_abs > 0:
            return self.max_abs / self.pytorch_max_abs
        return float("inf") if self.max_abs > 0 else 0.0


def compare_output(name: str, actual, expected, tol: Tolerance) -> OutputStats:
    """Error statistics; relative error is |a-b| / (|b| + atol) so near-zero values do not explode.

    ``tol`` is for outputs of order 1; it is applied at the scale of ``expected`` (``Tolerance.at_scale_of``)."""
    a, b = np.asarray(actual), np.asarray(expected)
    if a.shape != b.shape:
        inf = float("inf")
        return OutputStats(name, inf, inf, inf, inf, False, f"shape {list(a.shape)}, reference {list(b.shape)}")
    a, b = a.astype(np.float64), b.astype(np.float64)
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    same_specials = bool(np.array_equal(finite_a, finite_b)) and bool(
        np.array_equal(a[~finite_a], b[~finite_b], equal_nan=True))
    a_f, b_f = np.where(finite_a, a, 0.0), np.where(finite_b, b, 0.0)
    tol = tol.at_scale_of(b)
    abs_err = np.abs(a_f - b_f)
    rel_err = abs_err / (np.abs(b_f) + tol.atol)
    return OutputStats(
        name,
        float(abs_err.max(initial=0.0)),
        float(abs_err.mean()) if abs_err.size else 0.0,
        float(rel_err.max(initial=0.0)),
        float(rel_err.mean()) if rel_err.size else 0.0,
        same_specials and tol.allclose(a_f, b_f),
        "" if same_specials else "inf/NaN where the reference has none (or the other way round)",
    )


def compare_against_pytorch(name: str, actual, expected, pytorch, tol: Tolerance, rule: AgainstPyTorch) -> OutputStats:
    """``compare_output``'s statistics, passed by the measured rule: error(actual vs the higher-precision
    ``expected``) <= rule.bound(error(PyTorch in the file's dtype vs ``expected``)) (``tolerances`` module doc)."""
    stats = compare_output(name, actual, expected, tol)
    if stats.problem and stats.max_abs == float("inf"):
        return stats
    reference = compare_output(name, pytorch, expected, tol)
    b = np.asarray(expected, np.float64)
    finite = b[np.isfinite(b)]
    scale = float(np.sqrt(np.mean(finite * finite))) if finite.size else 0.0
    stats.pytorch_max_abs = reference.max_abs
    stats.bound = rule.bound(reference.max_abs, scale)
    stats.passed = not stats.problem and stats.max_abs <= stats.bound
    return stats


def token_errors(actual, expected) -> np.ndarray | None:
    """Max abs error per token of a [B, S, ...] output (None when shapes differ or it has no token axes)."""
    a, b = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if a.shape != b.shape or a.ndim < 2:
        return None
    err = np.abs(np.where(np.isfinite(a), a, 0.0) - np.where(np.isfinite(b), b, 0.0))
    return err.reshape(a.shape[0], a.shape[1], -1).max(axis=-1)


def limit_ratio(actual, expected, tol: Tolerance, allowance=0.0) -> np.ndarray:
    """|a - b| over the limit applied to it, ``atol + rtol * |b| + allowance`` (numpy.allclose's rule plus a
    position allowance, broadcast like ``b``): a value passes when its ratio is at most 1. A NaN difference
    counts as inf; inf against an inf limit (a token passed through, NaN expected) as 0, as the comparison
    ``err > limit`` judged it. The sweep decides with it and the error plot draws it, so the two agree."""
    a, b = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    err = np.abs(np.nan_to_num(a - b, nan=np.inf))
    with np.errstate(invalid="ignore"):
        ratio = err / (tol.atol + tol.rtol * np.abs(b) + allowance)
    return np.nan_to_num(ratio, nan=0.0, posinf=np.inf)


def token_limit_ratios(actual, expected, tol: Tolerance) -> np.ndarray | None:
    """The worst ``limit_ratio`` per token of a [B, S, ...] output, with ``tol`` at the output's scale as
    ``compare_output`` applies it (None when shapes differ or it has no token axes)."""
    a, b = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if a.shape != b.shape or a.ndim < 2:
        return None
    finite = np.isfinite(a) & np.isfinite(b)  # inf/NaN are judged apart (compare_output's specials)
    ratio = limit_ratio(np.where(finite, a, 0.0), np.where(finite, b, 0.0), tol.at_scale_of(b))
    return ratio.reshape(a.shape[0], a.shape[1], -1).max(axis=-1)


def bucket_of(position: int) -> int:
    """-1 for negative positions, 0 for 0, k for [2^(k-1), 2^k)."""
    return -1 if position < 0 else int(position).bit_length()


def bucket_range(bucket: int) -> tuple[int, int] | None:
    if bucket < 0:
        return None
    return (0, 0) if bucket == 0 else (1 << (bucket - 1), (1 << bucket) - 1)


def bucket_label(bucket: int) -> str:
    span = bucket_range(bucket)
    return "< 0" if span is None else (f"{span[0]}" if span[0] == span[1] else f"{span[0]}-{span[1]}")


@dataclass
class PositionErrors:
    """Max error per power-of-two bucket of positions (and how many tokens each bucket saw), and, where the
    caller gives it, the worst error as a fraction of the limit applied to it (``limit_ratio``: <= 1 passes)."""

    worst: dict[int, float] = field(default_factory=dict)
    count: dict[int, int] = field(default_factory=dict)
    ratio: dict[int, float] = field(default_factory=dict)

    def add(self, positions, errors, ratios=None) -> None:
        positions = np.asarray(positions).reshape(-1)
        errors = np.asarray(errors, np.float64).reshape(-1)
        ratios = None if ratios is None else np.asarray(ratios, np.float64).reshape(-1)
        buckets = np.where(positions < 0, -1, np.frexp(np.maximum(positions, 0).astype(np.float64))[1])
        buckets = np.where(positions == 0, 0, buckets).astype(np.int64)
        for bucket in np.unique(buckets):
            inside = buckets == bucket
            b = int(bucket)
            self.worst[b] = max(self.worst.get(b, 0.0), float(errors[inside].max()))
            self.count[b] = self.count.get(b, 0) + int(inside.sum())
            if ratios is not None:
                self.ratio[b] = max(self.ratio.get(b, 0.0), float(ratios[inside].max()))

    def buckets(self) -> list[dict]:
        out = []
        for b in sorted(self.worst):
            span = bucket_range(b)
            out.append({"from": None if span is None else span[0], "to": None if span is None else span[1],
                        "label": bucket_label(b), "tokens": self.count[b], "max_abs": self.worst[b],
                        **({"of_limit": self.ratio[b]} if b in self.ratio else {})})
        return out


def position_buckets(points: list[tuple[int, float]]) -> list[dict]:
    """Max error per power-of-two bucket of (position, error) points."""
    errors = PositionErrors()
    if points:
        errors.add([p for p, _ in points], [e for _, e in points])
    return errors.buckets()


def row_ranges(rows) -> list[tuple[int, int]]:
    """Sorted row indices as (first, last) runs: [3, 4, 5, 9] -> [(3, 5), (9, 9)]."""
    rows = sorted(int(r) for r in rows)
    runs: list[list[int]] = []
    for r in rows:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return [(a, b) for a, b in runs]


def describe_ranges(runs: list[tuple[int, int]], limit: int = 4) -> str:
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit])
    return text + (f" and {len(runs) - limit} more" if len(runs) > limit else "")
