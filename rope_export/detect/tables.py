"""Numeric tests that tell cos/sin tables from other tensors (used by ``witness``): cos² + sin² is one
constant, rows (last axis) that are zero in both allowed (a padding position's row), or constant per
row only (a scaled rotation: a padding row that is not zero, a per-position scale).

Tables are recognised by what they hold wherever they come from: computed by trig ops in the forward,
buffers and attributes made before it, or constants no module owns (tested where they are used).
"""

from __future__ import annotations

import torch

TABLE_RTOL = 2e-2  # c² + s² = const within this (bf16 tables are coarse); random data is far off
SAMPLE = 4096  # elements looked at before a full check of a large candidate table


ZERO = 1e-12  # c² + s² at or below this is a zero entry (a padding row), not a magnitude


def _magnitude(squared: torch.Tensor) -> str | None:
    """What ``squared`` (c² + s² per element) says about a table, within TABLE_RTOL:

    * ``"unit"``: one positive constant, except rows (last axis) that are zero throughout: a row of
      zeros (a padding position) gives zeros, as the rotary op does with a zero cache row;
    * ``"rows"``: constant along every row but not between rows (a padding row that is not zero,
      a per-position scale): a scaled rotation, not plain RoPE;
    * None: anything else (cos and sin of different angles, random data).
    """
    if squared.numel() == 0:
        return None
    rows = squared.reshape(-1, squared.shape[-1]) if squared.dim() else squared.reshape(1, 1)
    zero = rows <= ZERO
    dead = zero.all(dim=-1)
    if bool((zero.any(dim=-1) & ~dead).any()) or bool(dead.all()):
        return None  # zeros only in part of a row, or nothing but zeros
    live = rows[~dead]
    mid = live.median()
    if bool(((live - mid).abs() <= TABLE_RTOL * mid).all()):
        return "unit"
    row_mid = live.median(dim=-1, keepdim=True).values
    return "rows" if bool(((live - row_mid).abs() <= TABLE_RTOL * row_mid).all()) else None


def _constant_magnitude(squared: torch.Tensor) -> bool:
    """``squared`` (c² + s² per element) is one positive constant, within TABLE_RTOL, rows of zeros aside."""
    return _magnitude(squared) == "unit"


def _varies(t: torch.Tensor) -> bool:
    return t.numel() > 1 and bool((t != t.reshape(-1)[0]).any())


def _sample(t: torch.Tensor) -> torch.Tensor:
    """Leading rows of ``t`` with at most ~SAMPLE elements (a cheap first look)."""
    if t.numel() <= SAMPLE or t.dim() == 0:
        return t
    rows = max(1, SAMPLE // max(1, t[0].numel()))
    return t[:rows]


def _single_table(t: torch.Tensor) -> bool:
    """A trig table by itself: complex of constant magnitude, stacked [..., 2] or halves [c | s]
    (rows of zeros allowed: padding positions)."""
    if t.numel() < 4 or t.dim() == 0:
        return False
    for full in (False, True):
        x = t if full else _sample(t)
        x = x.detach()
        if x.is_complex():
            ok = _constant_magnitude(x.abs().double() ** 2) and _varies(torch.angle(x))
        elif not x.is_floating_point():
            return False
        elif x.shape[-1] == 2:
            ok = _pair_kind(x[..., 0], x[..., 1]) == "unit"
        elif x.shape[-1] % 2 == 0:
            h = x.shape[-1] // 2
            ok = _pair_kind(x[..., :h], x[..., h:]) == "unit"
        else:
            return False
        if not ok:
            return False
    return True


def _pair_kind(c: torch.Tensor, s: torch.Tensor) -> str | None:
    """``_magnitude`` of c² + s² for two tensors of one shape, where c is a cos table: it varies and
    takes values strictly between 0 and the magnitude (a 0/1 mask and its complement do not)."""
    c, s = c.detach().double(), s.detach().double()
    squared = c * c + s * s
    kind = _magnitude(squared)
    if kind is None or not _varies(c) or (kind == "rows" and c.shape[-1] < 2):
        return None
    live = squared > ZERO
    ratio = c[live].abs() / squared[live].sqrt()
    return kind if bool(((ratio > 0.05) & (ratio < 0.95)).any()) else None


def _pythagorean(c: torch.Tensor | None, s: torch.Tensor | None, strict: bool = False) -> str | None:
    """Whether the factors of two terms are cos and sin of the same angles: ``_pair_kind`` ("unit": c² + s²
    is constant, "rows": constant per row only, a scaled rotation), or None.

    Factors that do not broadcast against each other (terms joined before their sum) are not
    compared; unless ``strict`` (factors not known to be trig), the terms count as a rotation then.
    """
    if c is None or s is None:
        return None if strict else "unit"
    try:
        c, s = torch.broadcast_tensors(c.detach(), s.detach())
    except RuntimeError:
        return None if strict else "unit"
    if c.is_complex() or s.is_complex():
        return None if strict else "unit"
    if not (c.is_floating_point() and s.is_floating_point()):
        return None
    kind = _pair_kind(c, s)
    if kind is None and not strict and _magnitude(c.double() ** 2 + s.double() ** 2) == "unit":
        return "unit"  # trig values already (e.g. cos = 1, sin = 0 at position 0 only)
    return kind


def _pair_table(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """(a, b) are a cos/sin pair: same shape, ``_pair_kind`` on a sample, then on the whole."""
    if a.shape != b.shape or not (a.is_floating_point() and b.is_floating_point()) or a.numel() < 2:
        return None
    kind = None
    for full in (False, True):
        x, y = (a, b) if full else (_sample(a), _sample(b))
        kind = _pair_kind(x, y)
        if kind is None:
            return None
    return kind
