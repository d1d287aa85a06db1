"""The last check before a rewrite: the matched ops, run on random inputs, equal the op contract
with the caches the rewrite hands the fused node.

The site's own inputs are fed: the rotated tensor (random normal) and every graph input the
cos/sin path reads (position ids: random in-range integers; float inputs: random normal; inputs the
caller declares cos/sin tables, ``fuse(table_inputs=...)``: the cos and sin of random angles, one per
pair, laid out as the site pairs its channels, so the check proves the rotation for every table of
that kind and the fused node reads one value per pair). The
expected result is ``rope_export.op.onnx_op.rotary_numpy`` (the contract in NumPy) on the op's X with
the traced caches. A look-alike (cos and sin of different angles, a scale that is not RoPE, a
permutation that only looks like a rotation) differs by O(1) and is left alone.
"""

from __future__ import annotations

import numpy as np

from rope_export.op.onnx_op import rotary_numpy
from rope_export.op.tolerances import tolerance
from rope_export.passes._cos_sin import Trace, _numeric_step
from rope_export.passes._probe import Probe, ProbeError
from rope_export.passes._site import FOLDED, SkipSite, data_movement_leaves, folded_tokens, random_feeds, tokens_of
from rope_export.passes._values import dtype_name, dtype_of

SEED = 20261123
MAX_POSITION = 16  # random positions stay below this (and below half a gathered table)
# cos² + sin² must be one constant (1, or a magnitude factor such as YaRN's) within the caches'
# own rounding: fp32 ~1e-7, fp16 ~1e-3, bf16 ~8e-3 per value
MAGNITUDE_RTOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


def verify(probe: Probe, site) -> None:
    """Raise SkipSite unless the site's ops compute the contract with ``site``'s caches."""
    rng = np.random.default_rng(SEED)
    source = site.candidate.source
    feeds = {source: rng.standard_normal(site.source_shape).astype(source.dtype.numpy())}
    traces = (site.cos, site.sin)
    rows = min([t.table.shape[0] for t in traces if t.kind == "gather"] or [2 * MAX_POSITION])
    try:
        feeds.update(_table_feeds(probe, site, rng))
        feeds = random_feeds(probe, [site.y], feeds, rng, min(rows // 2, MAX_POSITION))
        wanted = [site.y, source if site.candidate.flatten_source else site.x]
        wanted += [site.candidate.cos_product] + [v for t in traces for v in _ingredients(t)]
        values = dict(zip(wanted, probe.run(wanted, feeds), strict=True))
    except ProbeError as exc:
        raise SkipSite(f"the numerical check could not run: {exc}") from exc
    x = values[wanted[1]].astype(values[site.y].dtype)
    if site.candidate.flatten_source:
        x = x.reshape(*x.shape[:-2], -1)
    product_shape = values[site.candidate.cos_product].shape
    # the op's X: the tensor itself, or reshaped as the rewrite does for the FOLDED layouts
    op_x = {"thd": lambda: x.reshape(1, x.shape[0], -1), "rows": lambda: x.reshape(-1, *x.shape[-2:])}.get(
        site.layout, lambda: x if site.layout == "bhsd" else x.reshape(x.shape[0], x.shape[1], -1))()
    batch, seq = (x.shape[0], x.shape[2]) if site.layout == "bhsd" else op_x.shape[:2]
    (cos, pos), (sin, _) = (_caches(t, values, probe, site, batch, seq, product_shape) for t in traces)
    if site.cos.kind != "gather":
        sin = sin * site.form.sin_sign
    _check_magnitude(cos, sin, _cache_dtype(site))
    rd_attr = site.form.rd if site.form.rd < site.form.width else 0
    args = dict(interleaved=int(site.form.interleaved), rotary_embedding_dim=rd_attr)
    if site.layout == "bhsd":
        expected = rotary_numpy(x, cos, sin, pos, num_heads=0, **args)
    else:
        expected = rotary_numpy(op_x, cos, sin, pos, num_heads=site.heads, **args).reshape(x.shape)
    got = site.candidate.unpermuted(values[site.y])
    name = _tolerance_name(got)
    # float32: two implementations of the contract; half types: the original may round each step
    kind = "op" if name == "float32" else "block"
    if got.shape != expected.shape or not tolerance(kind, name).allclose(got, expected):
        error = np.max(np.abs(got.astype(np.float64) - expected.astype(np.float64))) if got.shape == expected.shape \
            else float("nan")
        raise SkipSite(f"the numerical check failed: on random inputs the ops differ from the rotation by up to "
                       f"{error:.3g} (not RoPE: cos/sin of different angles, an extra scale, or another mix)")


def _table_feeds(probe: Probe, site, rng: np.random.Generator) -> dict:
    """cos and sin of random angles for the declared table inputs (``Probe.tables``) the site's cos and sin are
    read from by data movement: one angle per pair, repeated as the site's form pairs channels (interleaved:
    each twice in a row; rotate-half: the halves), channels past the rotated ones at angle 0."""
    cos_input, sin_input = (_table_input(v, probe.tables) for v in (site.candidate.cos, site.candidate.sin))
    if cos_input is None or sin_input is None or cos_input is sin_input:
        return {}
    shape, half = probe.shape(cos_input), site.form.rd // 2
    if shape is None or shape != probe.shape(sin_input) or shape[-1] < half:
        return {}
    angles = rng.uniform(-np.pi, np.pi, (*shape[:-1], half))
    if shape[-1] >= 2 * half:  # one value per channel: each angle twice
        angles = np.repeat(angles, 2, axis=-1) if site.form.interleaved else np.concatenate([angles, angles], -1)
    angles = np.concatenate([angles, np.zeros((*shape[:-1], shape[-1] - angles.shape[-1]))], axis=-1)
    return {cos_input: np.cos(angles).astype(cos_input.dtype.numpy()),
            sin_input: np.sin(angles).astype(sin_input.dtype.numpy())}


def _table_input(value, tables: frozenset[str]):
    """The one declared table input ``value`` is made of by data movement, or None."""
    if not tables:
        return None
    leaves = [v for v in data_movement_leaves(value, set()) if v.producer() is None and v.name in tables]
    return leaves[0] if len(leaves) == 1 else None


def _check_magnitude(cos: np.ndarray, sin: np.ndarray, dtype: str) -> None:
    """A rotation's cos/sin satisfy cos² + sin² = m² with one m; anything else is not RoPE."""
    squared = cos.astype(np.float64) ** 2 + sin.astype(np.float64) ** 2
    rows = squared.reshape(-1, squared.shape[-1]) if squared.ndim else squared.reshape(1, 1)
    dead = np.all(rows == 0, axis=-1)  # a padding position's row: zeros in, zeros out, in the op and the site
    if dead.any() and not dead.all():
        squared = rows[~dead]
    mid = float(np.median(squared))
    if mid <= 0 or np.max(np.abs(squared - mid)) > MAGNITUDE_RTOL.get(dtype, 3e-2) * mid:
        raise SkipSite(f"cos² + sin² is not constant (from {squared.min():.4g} to {squared.max():.4g}): not a plain "
                       "rotation (an xPos-style scaled rotation, or cos and sin of different angles)")


def _cache_dtype(site) -> str:
    return dtype_name(dtype_of(site.candidate.cos))


def _tolerance_name(array: np.ndarray) -> str:
    return {"float32": "float32", "float16": "float16"}.get(str(array.dtype), "bfloat16")


def _ingredients(trace: Trace) -> list:
    if trace.kind == "gather":
        return [trace.positions]
    return [trace.base]


def _caches(trace: Trace, values: dict, probe: Probe, site, batch: int, seq: int, product_shape: tuple):
    """(cache, positions or None) as float32 NumPy arrays for the contract."""
    if trace.kind == "gather":
        pos = np.asarray(values[trace.positions]).astype(np.int64)
        pos = np.broadcast_to(pos[None] if pos.ndim == 1 else pos, (batch, seq))
        return trace.table.astype(np.float32), np.ascontiguousarray(pos)
    base = np.asarray(values[trace.base])
    if trace.kind == "graph" and site.layout in FOLDED:
        tokens = folded_tokens(base, product_shape, site.layout, site.form, site.candidate.pairs)
    elif trace.kind == "graph":
        tokens = tokens_of(base, site.product_rank, site.layout, site.form, site.candidate.pairs)
    else:
        tokens = base
        for node, index in trace.steps:
            tokens = _numeric_step(tokens, node, index)
        if not trace.base_has_batch:
            tokens = tokens[None]
    tokens = np.broadcast_to(tokens.astype(np.float32), (batch, seq, site.form.rd // 2))
    return np.ascontiguousarray(tokens), None
