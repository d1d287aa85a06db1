"""What ``lower`` and ``fuse`` prove about the rotary nodes they emit, before anything is written.

Three checks, each cheap on a model of any size (the weights are never read):

* the caches against the node: their element type and shape as stored (the tensor's own header,
  not the graph's value_info, which an edited file can contradict): float32/float16/bfloat16,
  cos and sin alike, ``rd/2`` columns, ``[max_pos, rd/2]`` with position_ids, ``[B, S, rd/2]``
  without;
* where the caches are constant initializers: every element satisfies cos² + sin² = m² with one m
  for the whole cache (1 for most schemes; YaRN and LongRoPE fold a magnitude factor into the
  caches, constant per file). A changed row is not cos/sin of an angle and is named;
* the emitted nodes run once on a small input (the slice of the graph between each node's inputs
  and its output, ``_probe``): at most 2 sequences of 5 positions and, for a 4-D X whose node does
  not count its heads, 2 heads (1 sequence and 1 head where heads are large), whatever the file's
  static shape (a lowering bakes only head counts and head sizes into the graph, and those are
  kept); they are compared with the op contract in NumPy (``rotary_numpy``,
  which tests hold equal to the PyTorch reference):
  onnxruntime for the ``onnx``/``ort``/``decomposed`` forms (the runtime they are written for; its
  failure is the file's failure), onnx.reference with a kernel for our node or the trt-plugin node
  otherwise. A form no runtime here can run (bfloat16 under the ``ort`` contrib op) is noted.

A problem raises ``PassError``: one line naming the node, the problem and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from rope_export.op.contract import RotaryAttrs
from rope_export.op.tolerances import tolerance
from rope_export.passes._lower_base import LoweringLog, SiteError, read_site
from rope_export.passes._model import PassError
from rope_export.passes._probe import Probe, ProbeError
from rope_export.passes._values import FLOAT_TYPES, const_array, dim, dtype_name, dtype_of

SEED = 20261126
BATCH, SEQ, HEADS = 2, 5, 2  # the small input's sizes at most (fewer where the node's own are smaller)
FEW_ELEMENTS = 1 << 16  # past this many X elements, one sequence (and one head of a 4-D X) instead of two
MAX_RUN_ELEMENTS = 1 << 22  # X elements of a small input: past this (a huge hidden size), the node is not run
DEFAULT_ROWS = 16  # rows of a computed (non-constant) cache fed to the run
MAX_CACHE_ELEMENTS = 1 << 26  # a constant cache larger than this is not read (not a RoPE cache)
# cos² + sin² = m² within the caches' own rounding (as the fusion's verification allows)
MAGNITUDE_RTOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}
REBUILD = ("re-export the file (rope-export export), or rebuild the caches from the model's RoPE parameters "
           "(rope_export.op.rope_types)")


@dataclass
class NodeRun:
    """One node's small input and what the op contract says it must give."""

    label: str
    output: str  # the node's output name (a lowering keeps it)
    feeds: dict[str, np.ndarray]
    expected: np.ndarray
    dtype: str  # X's type name


def label_of(node: ir.Node) -> str:
    return node.name or f"RotaryEmbedding -> {node.outputs[0].name}"


def _refuse(node: ir.Node, problem: str, fix: str) -> PassError:
    return PassError(f"node {label_of(node)}: {problem}; {fix}")


def _stored(value: ir.Value):
    """The tensor behind a constant value (header only: dtype and shape, no data read), else None."""
    if value is None or value.is_graph_input():
        return None
    try:
        return ir.convenience.get_const_tensor(value)
    except ValueError:
        return None


def _cache_facts(node: ir.Node, cos: ir.Value, sin: ir.Value) -> tuple[ir.DataType | None, tuple | None]:
    """(element type, shape) of the caches as stored; refuse caches the op cannot take."""
    facts = []
    for name, value in (("cos_cache", cos), ("sin_cache", sin)):
        tensor = _stored(value)
        dtype = tensor.dtype if tensor is not None else dtype_of(value)
        shape = tuple(tensor.shape.numpy()) if tensor is not None else (
            None if value.shape is None else tuple(d if isinstance(d, int) else None for d in value.shape))
        if dtype is not None and dtype not in FLOAT_TYPES:
            raise _refuse(node, f"{name} {value.name!r} is {dtype_name(dtype)}; the op takes float32, float16 or "
                          "bfloat16 caches", "store both caches as float32 (or X's type)")
        facts.append((dtype, shape))
    (cos_type, cos_shape), (sin_type, sin_shape) = facts
    if None not in (cos_type, sin_type) and cos_type != sin_type:
        raise _refuse(node, f"cos_cache is {dtype_name(cos_type)} but sin_cache is {dtype_name(sin_type)}",
                      "store both caches in one type")
    if cos_shape is not None and sin_shape is not None and not _may_match(cos_shape, sin_shape):
        raise _refuse(node, f"cos_cache is {list(cos_shape)} but sin_cache is {list(sin_shape)}",
                      "give both caches one shape")
    return cos_type or sin_type, cos_shape if cos_shape is not None else sin_shape


def _may_match(a: tuple, b: tuple) -> bool:
    """Same rank, and no axis where both sizes are known and differ (a symbolic size may be either)."""
    return len(a) == len(b) and all(p is None or q is None or p == q for p, q in zip(a, b, strict=True))


def _rotary_dim(attrs: RotaryAttrs, x: ir.Value) -> int | None:
    if attrs.rotary_embedding_dim:
        return attrs.rotary_embedding_dim
    rank = x.shape.rank() if x.shape is not None else None
    if rank == 4:
        return dim(x, 3)
    hidden = dim(x, 2) if rank == 3 else None
    return hidden // attrs.num_heads if hidden and attrs.num_heads else None


def check_node(node: ir.Node, memo: dict | None = None, magnitude: bool = True) \
        -> tuple[RotaryAttrs, ir.DataType | None, tuple | None]:
    """Static checks of one rope_export::RotaryEmbedding node and its caches (stored types and shapes;
    with ``magnitude``, also cos² + sin² of constant caches); returns (attributes, cache type, cache
    shape). ``memo`` keeps the caches read (every layer's q and k share one pair: read once)."""
    memo = {} if memo is None else memo
    inputs = list(node.inputs)
    if len(inputs) < 3 or any(v is None for v in inputs[:3]):
        raise _refuse(node, "the node needs inputs X, cos_cache, sin_cache", "re-export the file")
    x, cos, sin = inputs[:3]
    pos = inputs[3] if len(inputs) > 3 else None
    cache_type, cache_shape = _cache_facts(node, cos, sin)
    try:
        site = read_site(node)
    except SiteError as exc:
        raise _refuse(node, str(exc), "fix the node or re-export the file (rope-export export)") from None
    attrs = site.attrs
    if cache_type is not None and cache_type not in (site.x_dtype, ir.DataType.FLOAT):
        raise _refuse(node, f"the caches are {dtype_name(cache_type)} under {dtype_name(site.x_dtype)} X",
                      "store them as float32 or in X's type")
    if cache_shape is not None:
        want_rank = 2 if pos is not None else 3
        if len(cache_shape) != want_rank:
            layout = "[max_pos, rd/2] with position_ids" if pos is not None else "[B, S, rd/2] without position_ids"
            raise _refuse(node, f"the caches are {list(cache_shape)}, the op needs {layout}",
                          "give the caches that shape")
        rd = _rotary_dim(attrs, x)
        width = cache_shape[-1]
        if rd is not None and width is not None and width != rd // 2:
            raise _refuse(node, f"the caches have {width} columns, rotating {rd} channels needs rd/2 = {rd // 2}",
                          f"store caches of {rd // 2} columns (cos/sin of the {rd // 2} inverse frequencies)")
    if magnitude and ("checked", cos, sin) not in memo:
        _check_magnitude(node, cos, sin, memo)
        memo["checked", cos, sin] = True
    return attrs, cache_type, cache_shape


def stored_array(value: ir.Value, memo: dict) -> np.ndarray | None:
    """A constant cache's values (read once, lazily from external data), or None: not constant, or too
    large to be a RoPE cache."""
    if value not in memo:
        tensor = _stored(value)
        memo[value] = const_array(value) if tensor is not None and tensor.size <= MAX_CACHE_ELEMENTS else None
    return memo[value]


def _check_magnitude(node: ir.Node, cos_value: ir.Value, sin_value: ir.Value, memo: dict) -> None:
    """Constant caches of a rotation: cos² + sin² = m², one m per file; name the rows that break it."""
    cos, sin = stored_array(cos_value, memo), stored_array(sin_value, memo)
    if cos is None or sin is None or cos.shape != sin.shape:
        return
    value, other = cos_value, sin_value
    squared = cos.astype(np.float64) ** 2 + sin.astype(np.float64) ** 2
    rows = squared.reshape(-1, squared.shape[-1])
    if not np.all(np.isfinite(rows)):
        bad = np.flatnonzero(~np.all(np.isfinite(rows), axis=1))
        raise _refuse(node, f"the caches hold inf or nan in row(s) {_rows(bad)}", REBUILD)
    # a row of zeros in both caches (a padding position's row) is allowed: the op gives zeros for its tokens,
    # as the decomposed x * 0 + rot(x) * 0 it replaces did; the magnitude is that of the other rows
    dead = np.all(rows == 0, axis=1) if not np.all(rows == 0) else np.zeros(rows.shape[0], bool)
    mid = float(np.median(rows[~dead]))
    rtol = MAGNITUDE_RTOL.get(str(cos.dtype), 3e-2)
    off = (np.abs(rows - mid) > rtol * max(mid, 1e-30)) & ~dead[:, None]
    if mid <= 0 or off.any():
        bad = np.flatnonzero(off.any(axis=1)) if mid > 0 else np.arange(rows.shape[0])
        worst = float(rows[bad[0]][np.argmax(np.abs(rows[bad[0]] - mid))])
        raise _refuse(node, f"cos² + sin² of {value.name!r}/{other.name!r} is not one constant: row(s) {_rows(bad)} "
                      f"give {worst:.4g} where the others give {mid:.4g}, so they are not cos/sin of an angle "
                      "(times one magnitude factor)", REBUILD)


def _rows(indices: np.ndarray) -> str:
    shown = ", ".join(str(int(i)) for i in indices[:5])
    return shown + (f" and {len(indices) - 5} more" if len(indices) > 5 else "")


def plan(model: ir.Model, nodes: list[ir.Node], *, out_of_range: bool, log: LoweringLog | None = None) \
        -> list[NodeRun]:
    """Check every node statically and make its small input and expected output (nodes of the main
    graph; those in functions or subgraphs get the static checks only).

    ``out_of_range``: also feed positions outside the cache (the contract passes those tokens
    through); False for files lowered with --trust-positions, whose op must not see them. ``log``: told of
    a node whose small input is still too large to run (a 3-D X of a huge hidden size)."""
    rng = np.random.default_rng(SEED)
    shared: dict[str, np.ndarray] = {}  # caches and positions, fed once for the nodes that share them
    memo: dict = {}
    runs = []
    for node in nodes:
        attrs, cache_type, cache_shape = check_node(node, memo)
        if node.graph is model.graph:
            run_ = _node_run(node, attrs, cache_type, cache_shape, rng, shared, out_of_range, memo)
            if run_ is not None:
                runs.append(run_)
            elif log is not None:
                log.note(f"node {label_of(node)} not run once on a small input: even at one or two sequences of a "
                         f"few positions its X has more than {MAX_RUN_ELEMENTS:,} elements (checked statically only)")
    return runs


def run(model: ir.Model, runs: list[NodeRun], runtime: str, form: str, log: LoweringLog | None = None) -> None:
    """Run the emitted form of every planned node on its small input; refuse a result off the contract.

    ``runtime``: "onnxruntime" or "reference"; ``form``: what the nodes became, for the messages."""
    values = _values_by_name(model.graph)
    for start in range(0, len(runs), CHUNK):
        chunk = runs[start:start + CHUNK]
        try:
            got = _evaluate(model, values, chunk, runtime)
        except _Failed:  # name the node that does not run
            got = []
            for one in chunk:
                try:
                    got += _evaluate(model, values, [one], runtime)
                except _Failed as exc:
                    raise PassError(f"node {one.label}: its {form} form does not run on {RUNTIME_NAMES[runtime]} "
                                    f"({exc}); {BUG}") from None
        for one, actual in zip(chunk, got, strict=True):
            _compare(one, actual, form, runtime)
    if log is not None and runs:
        log.note(f"ran {len(runs)} {form} node(s) once on a small input on {RUNTIME_NAMES[runtime]}: each equals "
                 "the op contract")


CHUNK = 8  # nodes per evaluation (the probe refuses a slice past its node limit)
RUNTIME_NAMES = {"onnxruntime": "onnxruntime (CPU)", "reference": "onnx.reference"}
BUG = "this is a bug in rope-export: report it, and use --target decomposed meanwhile"


class _Failed(Exception):
    pass


def _values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    values = {v.name: v for v in graph.inputs if v.name}
    values.update({name: v for name, v in graph.initializers.items()})
    for node in graph:
        values.update({v.name: v for v in node.outputs if v.name})
    return values


def _evaluate(model: ir.Model, values: dict[str, ir.Value], runs: list[NodeRun], runtime: str) -> list[np.ndarray]:
    outputs, feeds = [], {}
    for one in runs:
        if one.output not in values:
            raise PassError(f"node {one.label}: its output {one.output!r} is gone from the emitted graph; {BUG}")
        outputs.append(values[one.output])
        feeds.update({values[name]: array for name, array in one.feeds.items() if name in values})
    try:
        return Probe(model, infer=False).run(outputs, feeds, runtime=runtime, new_ops=_trt_plugin_ops())
    except ProbeError as exc:
        raise _Failed(str(exc)) from None


def _compare(one: NodeRun, actual: np.ndarray, form: str, runtime: str) -> None:
    expected = one.expected
    tol = tolerance("op", one.dtype)
    if actual.shape == expected.shape and actual.dtype == expected.dtype and tol.allclose(actual, expected):
        return
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        problem = f"gives {actual.dtype}{list(actual.shape)} where the op gives {expected.dtype}{list(expected.shape)}"
    else:
        a, b = actual.astype(np.float64), expected.astype(np.float64)
        both_nan = np.isnan(a) & np.isnan(b)
        error = float(np.max(np.where(both_nan, 0.0, np.abs(a - b))))
        problem = f"differs from the op contract by up to {error:.3g} (tolerance {tol.atol:g} + {tol.rtol:g}*|y|)"
    raise PassError(f"node {one.label}: run once on {RUNTIME_NAMES[runtime]} on a small input, its {form} form "
                    f"{problem}; {BUG}")


def _trt_plugin_ops() -> list[type]:
    """onnx.reference kernels for the trt-plugin node: the op contract in NumPy (the routing attributes
    only select TensorRT's plugin). Compared with the contract under the node's attributes before lowering,
    so a lost or wrong attribute shows."""
    from onnx.reference.op_run import OpRun

    from rope_export.op.nodes import PLUGIN_OP_TYPES, TRT_PLUGIN_DOMAIN
    from rope_export.op.onnx_op import rotary_numpy

    def _run(self, X, cos_cache, sin_cache, position_ids=None, interleaved=None, num_heads=None,
             rotary_embedding_dim=None, plugin_namespace=None, plugin_version=None):
        return (rotary_numpy(X, cos_cache, sin_cache, position_ids, interleaved=interleaved or 0,
                             num_heads=num_heads or 0, rotary_embedding_dim=rotary_embedding_dim or 0),)

    # OpRun classes are matched by class name (the op type) and op_domain
    return [type(op_type, (OpRun,), {"op_domain": TRT_PLUGIN_DOMAIN, "_run": _run}) for op_type in PLUGIN_OP_TYPES]


def _small(size: int | None, cap: int) -> int:
    """A size of the small input: the node's own where static and small, else ``cap`` (0, an empty batch, gets
    ``cap`` too: an empty run would prove nothing)."""
    return min(size, cap) if size else cap


def _x_shape(x: ir.Value, attrs: RotaryAttrs, pos, cache_shape, width) -> tuple[int, ...]:
    """The small X: one or two sequences, a few positions, two heads of a 4-D X whose node does not name its head
    count, X's own head size (hidden size of a 3-D X: num_heads x head size, both fixed by the node). Never the
    file's full shape: onnxruntime's own RejectsHiddenSizeOverflow test has a static 2 x 32768 x 1 x 65536 X."""
    rank = x.shape.rank()
    seq_axis = 2 if rank == 4 else 1
    per_token = pos is None and cache_shape  # [B, S, rd/2] caches: their B and S are X's
    batch = _small(dim(x, 0) or (per_token and cache_shape[0]) or dim(pos, 0), BATCH)
    seq = _small(dim(x, seq_axis) or (per_token and cache_shape[1]) or dim(pos, 1), SEQ)
    rd = attrs.rotary_embedding_dim or None
    if rank == 4:
        head_dim = dim(x, 3) or rd or 2 * (width or 4)
        heads = attrs.num_heads or _small(dim(x, 1), HEADS)  # heads are independent, unless the node counts them
        if batch * heads * seq * head_dim > FEW_ELEMENTS and not attrs.num_heads:  # large heads: one of them
            heads = 1
        return (1 if batch * heads * seq * head_dim > FEW_ELEMENTS else batch), heads, seq, head_dim
    hidden = dim(x, 2)
    hidden = attrs.num_heads * (hidden // attrs.num_heads if hidden else (rd or 2 * (width or 4)))
    return (1 if batch * seq * hidden > FEW_ELEMENTS else batch), seq, hidden


def _node_run(node, attrs: RotaryAttrs, cache_type, cache_shape, rng, shared, out_of_range, memo) -> NodeRun | None:
    x, cos, sin = list(node.inputs)[:3]
    pos = list(node.inputs)[3] if len(node.inputs) > 3 else None
    x_type = dtype_of(x)
    width = cache_shape[-1] if cache_shape and cache_shape[-1] else None
    x_shape = _x_shape(x, attrs, pos, cache_shape, width)
    if math.prod(x_shape) > MAX_RUN_ELEMENTS:
        return None
    batch, seq = x_shape[0], x_shape[2 if len(x_shape) == 4 else 1]
    half = (attrs.rotary_embedding_dim or x_shape[-1] // (attrs.num_heads if len(x_shape) == 3 else 1)) // 2
    feeds = {x.name: (rng.standard_normal(x_shape) * 0.5).astype(x_type.numpy())}
    cache_np = (cache_type or ir.DataType.FLOAT).numpy()
    cos_a, sin_a = stored_array(cos, memo), stored_array(sin, memo)
    if cos_a is None or sin_a is None:
        rows = (cache_shape[0] if cache_shape and cache_shape[0] else DEFAULT_ROWS) if pos is not None else None
        shape = (rows, half) if pos is not None else (batch, seq, half)
        key = f"angles:{cos.name}:{sin.name}:{shape}"
        if key not in shared:
            shared[key] = rng.uniform(-np.pi, np.pi, shape)
        cos_a, sin_a = np.cos(shared[key]).astype(cache_np), np.sin(shared[key]).astype(cache_np)
    elif pos is None:  # stored per-token caches: the small input's sequences and positions
        cos_a, sin_a = cos_a[:batch, :seq], sin_a[:batch, :seq]
    feeds[cos.name], feeds[sin.name] = shared.setdefault(cos.name, cos_a), shared.setdefault(sin.name, sin_a)
    pos_a = None
    if pos is not None:
        stored_pos = const_array(pos)
        if stored_pos is not None:  # fed too, cut to the small input's sequences and positions
            pos_a = feeds[pos.name] = stored_pos[:batch, :seq] if stored_pos.ndim == 2 else stored_pos
        else:
            if pos.name not in shared:
                shared[pos.name] = _positions(rng, (batch, seq), feeds[cos.name].shape[0], out_of_range)
            pos_a = shared[pos.name]
            feeds[pos.name] = pos_a
    try:
        expected = _reference(feeds[x.name], feeds[cos.name], feeds[sin.name], pos_a, attrs)
    except ValueError as exc:  # RotaryContractError: sizes that break the contract
        raise _refuse(node, str(exc), "fix the node or re-export the file (rope-export export)") from None
    return NodeRun(label_of(node), node.outputs[0].name, feeds, expected, dtype_name(x_type))


def _positions(rng, shape: tuple[int, int], rows: int, out_of_range: bool) -> np.ndarray:
    """Random rows, with the first and the last row of the cache (and, where allowed, -1 and max_pos)."""
    pos = rng.integers(0, rows, shape).astype(np.int64)
    flat = pos.reshape(-1)
    special = [0, rows - 1] + ([-1, rows] if out_of_range else [])
    for i, p in enumerate(special[: flat.size]):
        flat[(i * 3) % flat.size] = p
    return pos


def _reference(x, cos, sin, pos, attrs: RotaryAttrs) -> np.ndarray:
    """The op contract in NumPy (``onnx_op.rotary_numpy``, written apart from every lowering and kernel
    and held equal to the PyTorch reference by tests/op/test_reference.py). NumPy rather than torch so
    that ``lower`` and ``fuse`` never import torch: it is most of their start-up."""
    from rope_export.op.onnx_op import rotary_numpy

    return rotary_numpy(x, cos, sin, pos, interleaved=int(attrs.interleaved), num_heads=attrs.num_heads,
                        rotary_embedding_dim=attrs.rotary_embedding_dim)
