"""What every lowering rule shares: the pattern (one ``rope_export::RotaryEmbedding`` node), the
reading of that node against the op contract (``RotarySite``), and the guard that keeps the
contract's out-of-range behaviour on targets whose op lacks it: per-token caches gathered with
clamped rows, and a select of X itself for the tokens outside the cache (``pass_through``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from rope_export.op.contract import DOMAIN, OP_TYPE, RotaryAttrs
from rope_export.passes._values import FLOAT_TYPES, dim, dtype_name, dtype_of, rank_of, same_dim


@dataclass
class RotarySite:
    """One rope_export::RotaryEmbedding node, read against rope_export.op.contract."""

    node: ir.Node
    x: ir.Value
    cos: ir.Value
    sin: ir.Value
    position_ids: ir.Value | None
    attrs: RotaryAttrs
    x_dtype: ir.DataType
    cache_dtype: ir.DataType
    rank: int
    heads: int | None  # static head count, when known
    head_dim: int | None
    rotary_dim: int | None  # channels rotated (attribute, else the head, else 2 * cache width)

    @property
    def label(self) -> str:
        return self.node.name or f"{OP_TYPE} -> {self.node.outputs[0].name}"

    @property
    def half(self) -> int | None:
        return None if self.rotary_dim is None else self.rotary_dim // 2

    @property
    def partial(self) -> bool:
        rd = self.attrs.rotary_embedding_dim
        return bool(rd) and (self.head_dim is None or rd < self.head_dim)


class SiteError(Exception):
    """Raised while reading a site; becomes the rule's failure reason."""


def _int_attr(node: ir.Node, name: str) -> int:
    attr = node.attributes.get(name)
    if attr is None:
        return 0
    if attr.type != ir.AttributeType.INT:
        raise SiteError(f"attribute {name} must be an int, got {attr.type.name}")
    return attr.as_int()


def read_site(node: ir.Node) -> RotarySite:
    """Check one custom node against the contract as far as the graph's static info allows."""
    inputs = list(node.inputs)
    if len(inputs) < 3 or any(v is None for v in inputs[:3]):
        raise SiteError("needs inputs X, cos_cache, sin_cache (and optionally position_ids)")
    x, cos, sin = inputs[:3]
    pos = inputs[3] if len(inputs) > 3 else None
    attrs = RotaryAttrs(bool(_int_attr(node, "interleaved")), _int_attr(node, "num_heads"),
                        _int_attr(node, "rotary_embedding_dim"))
    if _int_attr(node, "interleaved") not in (0, 1):
        raise SiteError("attribute interleaved must be 0 or 1")
    if attrs.num_heads < 0 or attrs.rotary_embedding_dim < 0:
        raise SiteError("num_heads and rotary_embedding_dim must be >= 0")
    x_dtype = dtype_of(x)
    if x_dtype not in FLOAT_TYPES:
        raise SiteError(
            f"X has {dtype_name(x_dtype)}; it must be float32, float16 or bfloat16 (if the type is unknown, "
            "give the graph inputs their types and run onnx.shape_inference.infer_shapes)"
        )
    cos_dtype, sin_dtype = dtype_of(cos), dtype_of(sin)
    if cos_dtype != sin_dtype or cos_dtype is None:
        raise SiteError(
            f"cos_cache ({dtype_name(cos_dtype)}) and sin_cache ({dtype_name(sin_dtype)}) must have one known type"
        )
    if cos_dtype not in (x_dtype, ir.DataType.FLOAT):
        raise SiteError(
            f"the caches must have X's type ({dtype_name(x_dtype)}) or float32, got {dtype_name(cos_dtype)}"
        )
    if pos is not None and dtype_of(pos) not in (None, ir.DataType.INT64):
        raise SiteError(f"position_ids must be int64, got {dtype_name(dtype_of(pos))}; insert a Cast to int64")
    rank = rank_of(x)
    if rank not in (3, 4):
        raise SiteError(
            "X's rank is unknown" if rank is None else f"X must be 4-D [B, H, S, D] or 3-D [B, S, H*D], got rank {rank}"
        )
    heads = head_dim = None
    if rank == 3:
        if attrs.num_heads <= 0:
            raise SiteError("3-D X [B, S, H*D] needs the num_heads attribute")
        heads = attrs.num_heads
        hidden = dim(x, 2)
        if hidden is not None:
            if hidden % heads:
                raise SiteError(f"3-D X has hidden size {hidden}, not a multiple of num_heads={heads}")
            head_dim = hidden // heads
    else:
        heads, head_dim = dim(x, 1), dim(x, 3)
        if attrs.num_heads and heads is not None and attrs.num_heads != heads:
            raise SiteError(f"num_heads={attrs.num_heads} but 4-D X [B, H, S, D] has H={heads}")
    cache_rank = rank_of(cos)
    want_rank = 2 if pos is not None else 3
    if cache_rank is not None and cache_rank != want_rank:
        raise SiteError(
            "with position_ids the caches must be [max_pos, rd/2]" if pos is not None
            else "without position_ids the caches must be per token [B, S, rd/2]"
        )
    cache_half = dim(cos, -1)
    rotary_dim = attrs.rotary_embedding_dim or head_dim or (2 * cache_half if cache_half else None)
    if rotary_dim is not None:
        if rotary_dim % 2:
            raise SiteError(f"the rotated dimension must be even, got {rotary_dim}")
        if head_dim is not None and rotary_dim > head_dim:
            raise SiteError(f"rotary_embedding_dim={rotary_dim} is larger than head_dim={head_dim}")
        if cache_half is not None and cache_half != rotary_dim // 2:
            raise SiteError(
                f"the caches are {cache_half} wide, the rotated dimension {rotary_dim} needs {rotary_dim // 2}"
            )
    return RotarySite(node, x, cos, sin, pos, attrs, x_dtype, cos_dtype, rank, heads, head_dim, rotary_dim)


def const(op, values, dtype=np.int64) -> ir.Value:
    return op.Constant(value=ir.tensor(np.asarray(values, dtype=dtype)))


def token_validity(op, site: RotarySite) -> ir.Value:
    """[B, S] bool: the position lies in [0, max_pos). Only for sites with position_ids."""
    pos = site.position_ids
    max_pos = dim(site.cos, 0)
    limit = const(op, max_pos) if max_pos is not None else op.Gather(op.Shape(site.cos), const(op, 0), axis=0)
    return op.And(op.GreaterOrEqual(pos, const(op, 0)), op.Less(pos, limit))


def per_token_caches(op, site: RotarySite, dtype: ir.DataType, valid: ir.Value | None) -> tuple[ir.Value, ir.Value]:
    """[B, S, rd/2] cos/sin in ``dtype``, gathered at clamped rows (``valid`` from token_validity).

    Tokens outside the cache read row 0; their result is discarded by ``pass_through``. Without
    position_ids the caches already are per token; caches shared by the batch (``[1, S, rd/2]``,
    which the node's runtime broadcasts but onnxruntime's kernels refuse at batch > 1) are expanded
    to X's batch.
    """
    cos, sin = site.cos, site.sin
    if site.position_ids is not None:
        safe = op.Where(valid, site.position_ids, const(op, 0))
        cos, sin = op.Gather(cos, safe, axis=0), op.Gather(sin, safe, axis=0)
    elif not (same_dim(site.cos, 0, site.x, 0) and same_dim(site.sin, 0, site.x, 0)):
        batch = op.Concat(op.Slice(op.Shape(site.x), const(op, [0]), const(op, [1]), const(op, [0])),
                          const(op, [1, 1]), axis=0)  # [B, 1, 1]: broadcasts [1, S, rd/2] to [B, S, rd/2]
        cos, sin = op.Expand(cos, batch), op.Expand(sin, batch)
    if site.cache_dtype != dtype:
        cos, sin = op.Cast(cos, to=dtype), op.Cast(sin, to=dtype)
    return cos, sin


def pass_through(op, valid: ir.Value | None, y: ir.Value, x: ir.Value, token_axes: tuple[int, int],
                 rank: int) -> ir.Value:
    """``y`` where the token's position lies in the cache, else ``x``: the contract's pass-through.

    A select, not an identity rotation: x*1 - y*0 turns inf into nan, a copy keeps every bit.
    ``token_axes``: where B and S sit in y/x (rank ``rank``); ``valid`` [B, S] is broadcast there.
    """
    if valid is None:
        return y
    axes = [a for a in range(rank) if a not in token_axes]
    return op.Where(op.Unsqueeze(valid, const(op, axes)), y, x)


def x_token_axes(site: RotarySite) -> tuple[int, int]:
    """Where B and S sit in X: [B, H, S, D] or [B, S, H*D]."""
    return (0, 2) if site.rank == 4 else (0, 1)


def cast_if(op, value: ir.Value, have: ir.DataType, want: ir.DataType) -> ir.Value:
    return value if have == want else op.Cast(value, to=want)


def math_dtype(site: RotarySite) -> ir.DataType:
    """The dtype a standard/contrib op runs in: float32 when float32 caches come with half X.

    The contract rotates in float32 with those caches. Casting the caches down to X's type instead
    rounds cos/sin to half precision, an error that large activations amplify through attention
    (an fp16 block with 10x activations then disagreed with PyTorch by 6e-2 instead of 2e-2), so
    X is cast up and the result back down: two Casts for the contract's exact math.
    """
    if site.cache_dtype == ir.DataType.FLOAT and site.x_dtype != ir.DataType.FLOAT:
        return ir.DataType.FLOAT
    return site.x_dtype


BFLOAT16_NOTE = (
    "bfloat16 X: the lowered file does not run on onnxruntime's CPU provider, which has no bfloat16 kernels for "
    "Where (the out-of-range pass-through), Add or MatMul; it runs on TensorRT and onnx.reference"
)


@dataclass
class LoweringLog:
    lowered: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


class LowerRotary(pattern.RewriteRuleClassBase, abc.ABC):
    """Base of the four lowering rules: pattern = one rope_export::RotaryEmbedding node."""

    target: str = ""

    def __init__(self, guard_positions: bool = True, log: LoweringLog | None = None):
        super().__init__(name=f"lower-rotary-to-{self.target}")
        self.guard_positions = guard_positions
        self.log = log if log is not None else LoweringLog()
        self._memo: dict = {}

    def validity(self, op, site: RotarySite) -> ir.Value | None:
        """``token_validity`` built once per (positions, cache); None without position_ids.

        Nodes are rewritten in graph order and each replacement lands after its node, so values
        made for the first node (q) are defined before the second one (k) uses them."""
        if site.position_ids is None:
            return None
        key = ("valid", site.position_ids, site.cos)
        if key not in self._memo:
            self._memo[key] = token_validity(op, site)
        return self._memo[key]

    def per_token(self, op, site: RotarySite, dtype: ir.DataType) -> tuple[ir.Value, ir.Value]:
        """``per_token_caches``, built once for the nodes that share caches and positions (q and k)."""
        key = (site.cos, site.sin, site.position_ids, dtype)
        if key not in self._memo:
            self._memo[key] = per_token_caches(op, site, dtype, self.validity(op, site))
        return self._memo[key]

    def select_and_cast(self, op, site: RotarySite, y: ir.Value, dtype: ir.DataType) -> ir.Value:
        """The op's result ``y`` (computed in ``dtype``) cast to X's dtype, out-of-range tokens X's own.

        The select runs in X's dtype, so it copies every bit (a round trip through float32 would
        not keep a nan's payload: onnxruntime's and onnx.reference's Casts make it canonical)."""
        y = cast_if(op, y, dtype, site.x_dtype)
        return pass_through(op, self.validity(op, site), y, site.x, x_token_axes(site), site.rank)

    def cleanup(self):
        self._memo.clear()

    def pattern(self, op, x, cos, sin):
        position_ids = pattern.Var("position_ids", can_match_none=True)
        return op.RotaryEmbedding(x, cos, sin, position_ids, _domain=DOMAIN, _outputs=["y"])

    def check(self, context, y, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        node = y.producer()
        try:
            site = read_site(node)
            self.check_site(site)
            if site.x_dtype == ir.DataType.BFLOAT16:
                self.log.note(BFLOAT16_NOTE)
        except SiteError as exc:
            label = node.name or f"{OP_TYPE} -> {y.name}"
            self.log.failures[label] = str(exc)
            return result.fail(str(exc), node)
        return result

    def rewrite(self, op, y, **_):
        site = read_site(y.producer())
        self.log.lowered.append(site.label)
        return self.emit(op, site)

    def check_site(self, site: RotarySite) -> None:  # noqa: B027 - optional hook
        """Raise SiteError when this target cannot express the site (name a target that can)."""

    @abc.abstractmethod
    def emit(self, op, site: RotarySite) -> ir.Value:
        """Build the replacement; return the value that replaces the node's output."""

    @classmethod
    def prepare(cls, model: ir.Model) -> ir.Model:
        """Opset adjustments before rewriting; may return a new model."""
        return model

    def as_rule(self) -> pattern.RewriteRule:
        return pattern.RewriteRule(self.pattern, self.rewrite, self.check, name=self.name,
                                   graph_post_visitor=self.cleanup)
