"""What a matched site computes, decided by running it on probes (``_probe``), never by its spelling.

A fusion rule's pattern only finds the arithmetic of a rotation (products with cos/sin joined by a
sum, or pair by pair); it hands a ``Candidate`` here: the tensor the rotated channels come from, the
cos and sin operands, and the value the fused node would replace. Then:

* ``data_movement_leaves`` / ``common_source`` confirm that the rotated operands are the source's
  channels moved around (Slice, Gather, Split, Reshape, Transpose, Concat, Neg, Cast...) and
  nothing else;
* ``classify`` runs the site with cos = 1, sin = 0 (it must return the source) and with cos = 0,
  sin = 1 (it returns the signed channel permutation the rotation uses), on channel-coded probes:
  rotate-half or interleaved pairs, the rotated width, and the sign of sin (``cat(x2, -x1)``
  spellings rotate by -angle);
* ``layout_of`` reads from cos's broadcast which axis holds the heads ([B, H, S, D] or [B, S, H, D]);
* ``verify`` finally runs the original ops on random inputs against the op contract with the
  caches the rewrite will use, so nothing that merely looks like RoPE is ever fused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from rope_export.passes._probe import Probe, ProbeError
from rope_export.passes._values import const_array, dim, dtype_name, dtype_of

# ops that only move or retype data; the inputs listed carry the data (the others are shapes/axes)
MOVERS = {"Slice", "Gather", "Split", "Squeeze", "Unsqueeze", "Reshape", "Transpose", "Neg", "Identity", "Cast",
          "Flatten", "Concat"}
CHAIN = {"Reshape", "Cast", "Identity", "Flatten", "Squeeze", "Unsqueeze"}  # keep the element order
MAX_VISITS = 200
MAX_PROBE_ELEMENTS = 1 << 26  # a site is run on tensors of at most this many elements (256 MB of float32)


class SkipSite(Exception):
    """Raised while analysing a site: it is left alone, the message says why."""


@dataclass
class Candidate:
    """What a rule's pattern found, before any check."""

    y: ir.Value  # the value the fused node replaces
    source: ir.Value  # the tensor the rotated channels come from (fed to the probes)
    x: ir.Value  # the op's X: the source in y's shape (the whole head for partial sites)
    cos: ir.Value  # the operands multiplied into the rotated channels
    sin: ir.Value
    cos_product: ir.Value  # a product with cos: its shape is cos broadcast against the channels
    pairs: bool  # cos/sin hold one value per pair (else duplicated to the full rotated width)
    # no value holds the tensor in y's shape (an optimizer merged the reshapes): X is the source
    # [..., d/2, 2] flattened, and ``x`` stands for y's shape only
    flatten_source: bool = False
    # y is the rotation with its axes permuted (``y = rotation.transpose(y_perm)``: a write into a transposed
    # buffer, whose transposes back an optimizer merged with the next ones); the rewrite transposes the node's output
    y_perm: tuple[int, ...] | None = None

    def unpermuted(self, y: np.ndarray) -> np.ndarray:
        """A probe value of ``y`` in the rotated tensor's own layout."""
        return y if self.y_perm is None else np.transpose(y, np.argsort(self.y_perm))


@dataclass(frozen=True)
class Form:
    interleaved: bool
    rd: int  # rotated channels (a prefix of the last axis)
    width: int  # channels of x's last axis
    sin_sign: int  # +1: the contract's sign; -1: the site rotates by -angle (cat(x2, -x1) spellings)


# -- data movement ------------------------------------------------------------------------------------

def _data_inputs(node: ir.Node | None) -> list[ir.Value] | None:
    """The data inputs of a node that only moves data, or None when the node computes."""
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in MOVERS:
        return None
    if node.op_type == "Concat":
        return [i for i in node.inputs if i is not None and const_array(i) is None]
    if node.op_type == "Gather" and const_array(node.inputs[1]) is None:
        return None  # a gather by computed indices is a lookup, not a channel move
    return [node.inputs[0]]


def data_movement_leaves(value: ir.Value, stop: set[ir.Value]) -> set[ir.Value]:
    """The values ``value`` is made of through data movement: members of ``stop`` where reached,
    else the first computed values (or graph inputs) met."""
    leaves: set[ir.Value] = set()
    stack, seen = [value], set()
    while stack and len(seen) < MAX_VISITS:
        v = stack.pop()
        if v in stop:
            leaves.add(v)
            continue
        if v in seen:
            continue
        seen.add(v)
        inputs = _data_inputs(v.producer())
        if inputs is None:
            leaves.add(v)
        else:
            stack.extend(inputs)
    return leaves


def cast_chain(value: ir.Value) -> list[ir.Value]:
    """``value`` and what it is a Cast/Identity of, nearest first."""
    chain = [value]
    node = value.producer()
    while node is not None and node.op_type in ("Cast", "Identity") and node.domain in ("", "ai.onnx"):
        chain.append(node.inputs[0])
        node = node.inputs[0].producer()
    return chain


def ancestors(value: ir.Value) -> list[ir.Value]:
    """Data-movement ancestors of ``value`` (itself first), nearest first."""
    order, frontier, seen = [], [value], {value}
    while frontier and len(order) < MAX_VISITS:
        v = frontier.pop(0)
        order.append(v)
        for i in _data_inputs(v.producer()) or []:
            if i not in seen:
                seen.add(i)
                frontier.append(i)
    return order


def common_source(values: list[ir.Value]) -> ir.Value | None:
    """The nearest value that every one of ``values`` is made of by data movement alone."""
    shared = set.intersection(*(set(ancestors(v)) for v in values))
    for candidate in ancestors(values[0]):
        if candidate in shared and candidate not in values and all(
            data_movement_leaves(v, {candidate}) == {candidate} for v in values
        ):
            return candidate
    return None


def climb_to_shape(probe: Probe, value: ir.Value, target: ir.Value) -> ir.Value | None:
    """``value`` or the nearest value it was reshaped/cast from that has ``target``'s shape (same
    rank and last dim, and the same sizes where both are known)."""
    v = value
    for _ in range(8):
        if _same_shape(probe, v, target):
            return v
        node = v.producer()
        if node is None or node.op_type not in CHAIN or node.domain not in ("", "ai.onnx"):
            return None
        v = node.inputs[0]
    return None


def _same_shape(probe: Probe, a: ir.Value, b: ir.Value) -> bool:
    if a.shape is None or b.shape is None or a.shape.rank() != b.shape.rank():
        return False
    last_a, last_b = dim(a, -1), dim(b, -1)
    if last_a is not None and last_b is not None:
        return last_a == last_b
    return probe.shape(a) is not None and probe.shape(a) == probe.shape(b)


# -- classification by probes ---------------------------------------------------------------------

def _codes(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Channel c holds c + 1 everywhere (exact in fp16 up to 2047 channels, bf16 up to 255)."""
    return np.broadcast_to((np.arange(shape[-1]) + 1).astype(dtype), shape).copy()


def _np_dtype(value: ir.Value) -> np.dtype:
    dtype = dtype_of(value)
    if dtype is None:
        raise SkipSite(f"the type of {value.name or 'a matched value'} is unknown (run shape inference)")
    return dtype.numpy()


def concrete_shape(probe: Probe, value: ir.Value, what: str) -> tuple[int, ...]:
    shape = probe.shape(value)
    if shape is None:
        raise SkipSite(f"the shape of {what} is not known (run shape inference)")
    return bounded(shape, what)


def bounded(shape: tuple[int, ...], what: str) -> tuple[int, ...]:
    """``shape``, unless a tensor of it is too large to run the site on (static sizes are the file's own: a
    decomposed copy of onnxruntime's overflow test has 2**32 elements)."""
    size = math.prod(shape)
    if size > MAX_PROBE_ELEMENTS:
        raise SkipSite(f"{what} is {list(shape)} at the file's static sizes ({size:,} elements), too large to run the "
                       "site on to check it; fuse a file exported with dynamic batch and sequence axes")
    return shape


def random_feeds(probe: Probe, outputs: list[ir.Value], feeds: dict, rng: np.random.Generator,
                 max_int: int = 8) -> dict:
    """``feeds`` plus random values for every graph input ``outputs`` need: integers (positions) in
    [0, max_int), floats normal."""
    feeds = dict(feeds)
    for leaf in probe.leaves(outputs, feeds):
        shape = concrete_shape(probe, leaf, f"the graph input {leaf.name!r}")
        dtype = _np_dtype(leaf)
        if np.issubdtype(dtype, np.integer):
            feeds[leaf] = rng.integers(0, max(1, max_int), shape).astype(dtype)
        else:
            feeds[leaf] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _cos_sin_shapes(probe: Probe, c: Candidate) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes cos and sin really have (evaluated: exporters' inferred dim names do not always
    agree with the inputs'), or as inferred when they cannot be evaluated on their own."""
    for value, what in ((c.cos, "cos"), (c.sin, "sin")):
        inferred = probe.shape(value)
        if inferred is not None:
            bounded(inferred, what)
    try:
        cos, sin = probe.run([c.cos, c.sin], random_feeds(probe, [c.cos, c.sin], {}, np.random.default_rng(0)))
        return cos.shape, sin.shape
    except (ProbeError, SkipSite):
        return concrete_shape(probe, c.cos, "cos"), concrete_shape(probe, c.sin, "sin")


def source_shape(probe: Probe, c: Candidate, cos_shape: tuple[int, ...], partial: bool) -> tuple[int, ...]:
    """The probe shape of the rotated tensor: as inferred when that broadcasts against cos; else
    (shape inference lost the sizes: TorchScript exports compute slice bounds with Div) built from
    cos: its batch and sequence sizes, a head count of its own, the channels cos holds (plus a
    few untouched ones for a partial site)."""
    inferred = probe.shape(c.source)
    rank = c.source.shape.rank() if c.source.shape is not None else None
    if inferred is not None and (len(inferred) != len(cos_shape) or _broadcasts(inferred[:-1], cos_shape[:-1])):
        return inferred
    if rank != len(cos_shape) or c.pairs:
        if inferred is None:
            raise SkipSite("the shape of the rotated tensor is not known (run shape inference)")
        return inferred
    taken = set(cos_shape)
    heads = next(size for size in (3, 7, 11, 13, 17, 19) if size not in taken)
    dims = []
    for axis in range(rank - 1):
        static = dim(c.source, axis)
        dims.append(static if static is not None else cos_shape[axis] if cos_shape[axis] > 1 else heads)
    last = dim(c.source, -1)
    dims.append(last if last is not None else cos_shape[-1] + (4 if partial else 0))
    return tuple(dims)


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    try:
        np.broadcast_shapes(a, b)
    except ValueError:
        return False
    return True


def classify(probe: Probe, c: Candidate, partial: bool = False) -> tuple[Form, tuple, tuple, tuple]:
    """Run the site with (cos, sin) = (1, 0) and (0, 1) on channel codes; read the form.

    Returns (form, cos's shape, the shape of cos's product with the channels, the rotated tensor's
    probe shape)."""
    cos_shape, sin_shape = _cos_sin_shapes(probe, c)
    shape = bounded(source_shape(probe, c, cos_shape, partial), "the rotated tensor")
    flat = (*shape[:-2], shape[-2] * shape[-1]) if c.flatten_source else shape
    codes = _codes(flat, _np_dtype(c.source))  # channel codes of the tensor in y's layout
    fed = codes.reshape(shape)
    ones = {c.cos: np.ones(cos_shape, _np_dtype(c.cos)), c.sin: np.ones(sin_shape, _np_dtype(c.sin))}
    zeros = {v: np.zeros_like(a) for v, a in ones.items()}
    try:
        same, product = probe.run([c.y, c.cos_product], {c.source: fed, c.cos: ones[c.cos], c.sin: zeros[c.sin]})
        (moved,) = probe.run([c.y], {c.source: fed, c.cos: zeros[c.cos], c.sin: ones[c.sin]})
    except ProbeError as exc:
        raise SkipSite(str(exc)) from exc
    same, moved = c.unpermuted(same), c.unpermuted(moved)
    if same.shape != codes.shape:
        raise SkipSite(f"the result's shape {list(same.shape)} differs from the rotated tensor's {list(codes.shape)}")
    if not np.array_equal(np.asarray(same, np.float64), codes.astype(np.float64)):
        raise SkipSite("with cos = 1 and sin = 0 the ops do not return the tensor unchanged: not a rotation")
    return _read_permutation(np.asarray(moved, np.float64)), cos_shape, product.shape, shape


def _read_permutation(moved: np.ndarray) -> Form:
    width = moved.shape[-1]
    columns = moved.reshape(-1, width)
    if not (columns == columns[:1]).all():
        raise SkipSite("with cos = 0 and sin = 1 the channels move between tokens or heads: not a rotation")
    values = columns[0]
    perm, sign = np.abs(values).astype(np.int64) - 1, np.sign(values).astype(np.int64)
    if (np.abs(values) != np.round(np.abs(values))).any() or (perm < 0).any() or (perm >= width).any():
        raise SkipSite("with cos = 0 and sin = 1 the result is not a signed copy of the tensor's channels")
    fixed = (perm == np.arange(width)) & (sign == 1)
    rd = width
    while rd > 0 and fixed[rd - 1]:
        rd -= 1
    if rd == 0 or rd % 2 or fixed[:rd].any():
        raise SkipSite(f"the channels that move ({np.flatnonzero(~fixed).tolist()}) are not an even prefix of the head")
    j = np.arange(rd)
    half = rd // 2
    layouts = {
        False: np.where(j < half, j + half, j - half),  # rotate-half: (i, i + rd/2)
        True: j ^ 1,  # interleaved: (2i, 2i + 1)
    }
    for interleaved, partner in layouts.items():
        first = (j < half) if not interleaved else (j % 2 == 0)
        if (perm[:rd] == partner).all():
            s0 = sign[:rd][first]
            if (s0 == s0[0]).all() and (sign[:rd][~first] == -s0[0]).all():
                return Form(interleaved, rd, width, sin_sign=-int(s0[0]))
    raise SkipSite(f"the rotated channels are paired neither as rotate-half nor as interleaved: {perm[:rd].tolist()}")


# layouts the op does not take, fused by an exact reshape of X around the node (caches per op token):
# "thd": token-major [T, H, D] as [1, T, H*D] (num_heads H); "rows": every [.., M, D] row of X as its
# own op token, [N, M, D] with num_heads 1 (per-head cos/sin: heads folded into the batch)
FOLDED = ("thd", "rows")


def layout_of(x: ir.Value, cos_shape: tuple[int, ...], product_shape: tuple[int, ...]) -> tuple[str, int | None]:
    """("bhsd", "bshd", "sbhd", "thd" or "rows", heads): the heads axis is where cos is broadcast (size 1),
    the sequence where it varies. "sbhd" is fused as "bshd" with the two token axes swapped, "thd" and
    "rows" by a reshape of X (``FOLDED``); all three with per-token caches only."""
    full, cos = product_shape, cos_shape
    if len(full) < 3:
        raise SkipSite(f"a rotation of {len(full)}-D rows with no head axis (the op takes 3-D or 4-D tensors)")
    if len(cos) > len(full):
        raise SkipSite(f"cos/sin ({len(cos)}-D) do not broadcast against the {len(full)}-D rotated tensor")
    cos = (1,) * (len(full) - len(cos)) + tuple(cos)
    rank = x.shape.rank() if x.shape is not None else None
    if len(full) == 3:
        if cos[0] == full[0] and cos[1] == 1 and full[0] > 1:
            layout = "thd"  # [T, H, D], cos [T, 1, D]: one cos/sin per token, shared by the heads
        elif cos[1] == full[1] and full[1] > 1:
            layout = "rows"  # [T, H, D] with cos/sin per head
        else:
            raise SkipSite("cos/sin do not vary along the tokens of the 3-D rotated tensor")
        return _folded(x, rank, layout, 3)
    if cos[0] not in (1, full[0]):
        raise SkipSite("cos/sin vary along the batch axis in a way the op cannot express")
    if cos[1] == 1 and cos[2] == full[2] and full[2] > 1:
        layout = "bhsd"
    elif cos[2] == 1 and cos[1] == full[1] and full[1] > 1:
        layout = "bshd"
    elif cos[1] == 1 and cos[2] == 1 and cos[0] > 1:
        # [S, B, H, D] (Megatron): without position_ids the op rotates each (axis 0, axis 1) token by its
        # own cache row, whichever axis is the sequence, so the tensor is taken as [B', S', H, D] with
        # B' = S, S' = B and per-token caches [S, B, rd/2] (cos broadcast along B)
        layout = "sbhd"
    elif cos[1] == 1 and cos[2] == 1:
        raise SkipSite("cos/sin do not vary along the sequence axis (axis 1 or 2 of the rotated tensor)")
    else:
        # per-head cos/sin: each [.., M, D] row of X becomes an op token of its own (exact, no transpose)
        return _folded(x, rank, "rows", len(full))
    if rank != 4:
        raise SkipSite(f"the rotated tensor is {rank if rank is not None else 'of unknown rank'}"
                       "-D; only 4-D [B, H, S, D] / [B, S, H, D] is fused")
    heads = dim(x, 1) if layout == "bhsd" else dim(x, 2)
    if layout != "bhsd" and heads is None:
        raise SkipSite("[B, S, H, D] tensor with a non-static head count (the fused op needs num_heads)")
    return layout, heads


def _folded(x: ir.Value, rank: int | None, layout: str, want: int) -> tuple[str, int | None]:
    what = "cos/sin vary per head" if layout == "rows" else "a token-major [T, H, D] tensor"
    if rank != want:  # the product's rows must be X's rows ([.., d/2, 1] pair products are not)
        raise SkipSite(f"{what}: the rotated tensor is {rank if rank is not None else 'of unknown rank'}-D, "
                       f"its product with cos {want}-D")
    if layout == "rows":
        return layout, 1
    heads = dim(x, 1)
    if heads is None:
        raise SkipSite("token-major [T, H, D] tensor with a non-static head count (the fused op needs num_heads)")
    return layout, heads


def folded_tokens(cos: np.ndarray, product_shape: tuple[int, ...], layout: str, form: Form,
                  pairs: bool) -> np.ndarray:
    """Per-op-token [B', S', rd/2] values of cos (or sin) for a ``FOLDED`` layout (NumPy twin of
    ``_cos_sin.folded_per_token_value``)."""
    full = np.broadcast_to(cos.reshape((1,) * (len(product_shape) - cos.ndim) + cos.shape),
                           (*product_shape[:-1], cos.shape[-1]))
    tokens = full[None, :, 0] if layout == "thd" else full.reshape(-1, product_shape[-2], cos.shape[-1])
    if pairs:  # already one value per pair
        return tokens[..., : form.rd // 2]
    return tokens[..., 0: form.rd: 2] if form.interleaved else tokens[..., : form.rd // 2]


def tokens_of(cos: np.ndarray, rank: int, layout: str, form: Form, pairs: bool) -> np.ndarray:
    """Per-token [B or 1, S, rd/2] values from cos (or sin) as the site multiplies by it (a product of
    rank ``rank``): head 0, the first channel of each pair."""
    full = cos.reshape((1,) * (rank - cos.ndim) + cos.shape)
    full = full[:, 0] if layout == "bhsd" else full[:, :, 0]
    full = full.reshape(full.shape[0], full.shape[1], -1)
    if pairs:
        return full[..., : form.rd // 2]
    return full[..., 0 : form.rd : 2] if form.interleaved else full[..., : form.rd // 2]


def check_dtype(y: ir.Value) -> str:
    dtype = dtype_of(y)
    if dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        raise SkipSite(f"the rotated tensor has {dtype_name(dtype)} (float32/float16/bfloat16 only)")
    return dtype_name(dtype)
