"""What the fusion rules share: the report, the check of a matched site (shapes, slices, the cos/sin
trace) and the replacement (one rope_export::RotaryEmbedding node, plus Reshapes for [B, S, H, D]).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from rope_export.contract import DOMAIN, OP_TYPE, OP_VERSION
from rope_export.passes._cos_sin import Trace, TraceError, gather_inputs, per_token_value, trace
from rope_export.passes._values import (
    FLOAT_TYPES,
    INT64_MAX,
    dim,
    dtype_name,
    dtype_of,
    last_element,
    normalize_axis,
    rank_of,
    static_ints,
    static_length,
)


@dataclass
class SiteRecord:
    site: str  # the output value of the decomposed rotation (before any partial Concat)
    status: str  # "fused", "left alone", "already fused", "other rotary op"
    form: str = ""  # rotate-half / interleaved (+ partial)
    detail: str = ""  # fused: layout, cos/sin source; left alone: why


@dataclass
class FusionReport:
    """What ``fuse`` saw: one row per site, fused or left alone (and why)."""

    records: dict[str, SiteRecord] = field(default_factory=dict)
    larger_form_misses: dict[str, str] = field(default_factory=dict)

    def fused(self, site: str, form: str, detail: str) -> None:
        note = self.larger_form_misses.pop(site, None)
        if note:
            detail += f"; not as {note}"
        self.records[site] = SiteRecord(site, "fused", form, detail)

    def left_alone(self, site: str, form: str, reason: str, larger_form: bool = False) -> None:
        """A rule saw the site and did not fuse it; ``larger_form``: a later stage may still fuse
        its inner core, and the row then says why the larger form did not apply."""
        if site in self.records and self.records[site].status == "fused":
            return
        if larger_form:
            self.larger_form_misses[site] = f"{form}: {reason}"
        self.records[site] = SiteRecord(site, "left alone", form, reason)

    def seen(self, site: str, status: str, form: str, detail: str) -> None:
        self.records[site] = SiteRecord(site, status, form, detail)

    @property
    def num_fused(self) -> int:
        return sum(r.status == "fused" for r in self.records.values())

    def rows(self) -> list[SiteRecord]:
        order = {"fused": 0, "already fused": 1, "left alone": 2, "other rotary op": 3}
        return sorted(self.records.values(), key=lambda r: (order.get(r.status, 9), r.site))

    def as_text(self) -> str:
        lines = [f"{'site':<32} {'status':<14} {'form':<26} detail"]
        for r in self.rows():
            lines.append(f"{r.site:<32} {r.status:<14} {r.form:<26} {r.detail}")
        return "\n".join(lines)


class SkipSite(Exception):
    """Raised by a rule's check: the site is left alone, the message says why."""


@dataclass
class Site:
    """A matched decomposed rotation, checked: everything the rewrite needs."""

    key: str
    x: ir.Value  # the tensor handed to the fused op (the whole head when partial)
    rd: int
    head_dim: int | None
    partial: bool
    cos: Trace
    sin: Trace
    layout: str  # "bhsd" or "bshd"
    heads: int | None
    cos_value: ir.Value
    sin_value: ir.Value


def is_last_axis(axes: ir.Value | None, rank: int) -> bool:
    values = static_ints(axes) if axes is not None else None
    return values is not None and len(values) == 1 and normalize_axis(values[0], rank) == rank - 1


def slice_bounds(node_inputs: list, rank: int, known: dict | None = None) -> tuple[int, int, int] | None:
    """(start, end, step) of a one-axis Slice on the last axis, else None."""
    starts, ends = node_inputs[1], node_inputs[2]
    axes = node_inputs[3] if len(node_inputs) > 3 else None
    steps = node_inputs[4] if len(node_inputs) > 4 else None
    if not is_last_axis(axes, rank):  # no axes input: the Slice is on axis 0
        return None
    s, e = static_ints(starts, known), static_ints(ends, known)
    st = [1] if steps is None else static_ints(steps, known)
    if s is None or e is None or st is None or len(s) != 1 or len(e) != 1 or len(st) != 1:
        return None
    return s[0], e[0], st[0]


def concat_on_last(node: ir.Node, rank: int) -> bool:
    axis = node.attributes.get("axis")
    return axis is not None and normalize_axis(axis.as_int(), rank) == rank - 1


def pairs_math(op, x1, x2, cos, sin):
    """Pattern of one rotation per pair: (x1*c - x2*s, x1*s + x2*c)."""
    y1 = op.Sub(op.Mul(x1, cos), op.Mul(x2, sin))
    y2 = op.Add(op.Mul(x1, sin), op.Mul(x2, cos))
    return y1, y2


def _unsqueeze_axes_of(node: ir.Node) -> list[int] | None:
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        return static_ints(node.inputs[1])
    attr = node.attributes.get("axes")
    return list(attr.as_ints()) if attr is not None else None


def check_stack_pairs(bindings: dict, rank: int) -> None:
    """The two Unsqueeze + Concat of ``torch.stack(..., dim=-1)`` on the pairs' new last axis."""
    for name in ("first_u", "second_u"):
        axes = _unsqueeze_axes_of(bindings[name].producer())
        if axes is None or len(axes) != 1 or axes[0] % (rank + 1) != rank:
            raise SkipSite("the pairs are not stacked on a new last axis")
    if not concat_on_last(bindings["stacked"].producer(), rank + 1):
        raise SkipSite("the pairs are not stacked on a new last axis")


def check_flatten_pairs(bindings: dict, rank: int, width: int) -> None:
    """The Reshape after the stack flattens [..., w/2, 2] back to [..., w] (rank ``rank``).

    It is rank ``rank`` and its last dim, where known, is ``width``; with the same element count
    and a result that broadcasts against x, that Reshape can only be ``flatten(-2)``.
    """
    flat, shape_value = bindings["flat"], bindings["flat_shape"]
    out_rank = rank_of(flat) or static_length(shape_value)
    out_last = dim(flat, -1) if rank_of(flat) else None
    if out_last is None:
        last = last_element(shape_value)
        out_last = width if last == -1 else last
    if out_rank != rank or out_last not in (None, width):
        raise SkipSite("the Reshape after the stack does not flatten the pairs back to the rotated width")


def key_of(value: ir.Value) -> str:
    return value.name or f"<{value.producer().op_type} output>"


class FuseRotary(pattern.RewriteRuleClassBase, abc.ABC):
    """Base of the fusion rules; a subclass gives the rotation ``core`` pattern and its checks.

    Variants (one rule object each): ``partial`` wraps the core in the partial split
    ``cat(core(q[..., :rd]), q[..., rd:])``; ``upcast`` (with partial) also allows the rotated part
    to be computed in float32, ``cat(cast(core(cast(q[..., :rd], f32)), q.dtype), q[..., rd:])``,
    which is exactly the op contract with float32 caches under a half-precision q.
    """

    form: str = ""  # "rotate-half" / "interleaved"
    dup: str | None = None  # how cos/sin repeat each frequency (see _cos_sin.trace)

    def __init__(self, report: FusionReport, memo: dict, partial: bool = False, upcast: bool = False):
        variant = ("-partial" if partial else "") + ("-upcast" if upcast else "")
        super().__init__(name=f"fuse-{self.form}{self.variant_tag}{variant}")
        self.partial = partial
        self.upcast = upcast
        self.report = report
        self.memo = memo

    variant_tag = ""

    def as_rule(self) -> pattern.RewriteRule:
        # remove_nodes=False: the matched nodes are left for the final dead-code pass rather than
        # removed at once, so a site still fuses when an intermediate value also feeds shape
        # arithmetic (the TorchScript exporter computes slice bounds from Shape(x[..., :rd])); if
        # such a value has a live consumer, its old computation simply stays.
        return pattern.RewriteRule(self.pattern, self.rewrite, self.check, name=self.name, remove_nodes=False)

    # -- pattern ----------------------------------------------------------------------------------
    @staticmethod
    def _slice(op, x, tag: str):
        return op.Slice(
            x,
            pattern.Var(f"{tag}_starts"),
            pattern.Var(f"{tag}_ends"),
            pattern.Var(f"{tag}_axes", can_match_none=True),
            pattern.Var(f"{tag}_steps", can_match_none=True),
            _outputs=[f"{tag}_out"],
        )

    @abc.abstractmethod
    def core(self, op, x, cos, sin):
        """The pattern of the rotation of x (its output named "core")."""

    def pattern(self, op, q, cos, sin):
        if not self.partial:
            if not self.upcast:
                return self.core(op, q, cos, sin)
            core = self.core(op, op.Cast(q, _outputs=["up"]), cos, sin)
            return op.Cast(core, _outputs=["down"])
        x = self._slice(op, q, "rot")
        if self.upcast:
            x = op.Cast(x, _outputs=["up"])
        core = self.core(op, x, cos, sin)
        if self.upcast:
            core = op.Cast(core, _outputs=["down"])
        return op.Concat(core, self._slice(op, q, "pass"), _outputs=["joined"])

    # -- check ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def check_rotation(self, x: ir.Value, rank: int, width: int, bindings: dict, known: dict) -> None:
        """Raise SkipSite unless the matched ops really rotate pairs of ``x``'s last ``width`` channels.

        ``known`` gives x's established dims (its last is ``width``) for shape arithmetic on it."""

    def width_from_pattern(self, rank: int, bindings: dict) -> int | None:
        """The rotated width read from the matched ops when the head dimension is not static."""
        return None

    def _site(self, q: ir.Value, cos: ir.Value, sin: ir.Value, core: ir.Value, bindings: dict) -> Site:
        bindings = dict(bindings, core=core)
        dtype = dtype_of(q)
        if dtype not in FLOAT_TYPES:
            raise SkipSite(f"the rotated tensor has {dtype_name(dtype)} (float32/float16/bfloat16 only)")
        rank = rank_of(q)
        if rank != 4:
            raise SkipSite("the rotated tensor is not known to be 4-D (run shape inference)" if rank is None
                           else f"the rotated tensor is {rank}-D; only 4-D [B, H, S, D] / [B, S, H, D] is fused")
        head_dim = dim(q, 3)
        compute_dtype = dtype
        if self.partial:
            rot = slice_bounds(list(bindings["rot_out"].producer().inputs), rank)
            rest = slice_bounds(list(bindings["pass_out"].producer().inputs), rank)
            joined = bindings["joined"].producer()
            if rot is None or rest is None or not concat_on_last(joined, rank):
                raise SkipSite("the rotated/untouched split is not two Slices of the last axis joined on it")
            (r0, rd, rs), (p0, p1, ps) = rot, rest
            covers = p1 == INT64_MAX or (head_dim is not None and p1 >= head_dim)
            if r0 != 0 or rs != 1 or ps != 1 or p0 != rd or not covers or rd <= 0 or (
                head_dim is not None and rd > head_dim
            ):
                raise SkipSite(f"the split [{r0}:{rd}] + [{p0}:{p1}] does not cover the head ({head_dim} channels)")
            x = bindings["up"] if self.upcast else bindings["rot_out"]
        else:
            x = bindings["up"] if self.upcast else q
            rd = head_dim if head_dim is not None else self.width_from_pattern(rank, bindings)
            if rd is None:
                raise SkipSite("the rotated width is not static (neither the head dimension nor the Slices)")
        if self.upcast:
            up, down = bindings["up"].producer(), bindings["down"].producer()
            if up.attributes["to"].as_int() != ir.DataType.FLOAT or down.attributes["to"].as_int() != dtype:
                raise SkipSite("the rotated part is cast to something other than float32 and back")
            compute_dtype = ir.DataType.FLOAT
        if rd % 2:
            raise SkipSite(f"odd rotated width {rd}")
        known_dims = [dim(x, i) for i in range(rank - 1)] + [rd]
        self.check_rotation(x, rank, rd, bindings, {x: known_dims})
        for value in (cos, sin):
            if dtype_of(value) != compute_dtype:
                raise SkipSite(f"cos/sin have {dtype_name(dtype_of(value))}, the rotation {dtype_name(compute_dtype)}")
        try:
            tc = trace(cos, self.dup, rd)
            ts = trace(sin, self.dup, rd)
        except TraceError as exc:
            raise SkipSite(str(exc)) from None
        if (tc.kind, tc.head_axis) != (ts.kind, ts.head_axis) or (
            tc.kind == "gather" and tc.positions is not ts.positions
        ):
            raise SkipSite("cos and sin come from different kinds of source")
        layout = "bhsd" if tc.head_axis == 1 else "bshd"
        heads = dim(q, 2) if layout == "bshd" else dim(q, 1)
        if layout == "bshd" and heads is None:
            raise SkipSite("[B, S, H, D] tensor with a non-static head count (the fused op needs num_heads)")
        partial = self.partial and (head_dim is None or rd < head_dim)
        return Site(key_of(core), q, rd, head_dim, partial, tc, ts, layout, heads, cos, sin)

    def _form(self) -> str:
        return self.form + self.variant_tag

    def check(self, context, q, cos, sin, core, **bindings) -> pattern.MatchResult:
        result = pattern.MatchResult()
        form = self._form() + (" (partial)" if self.partial else "") + (" in float32" if self.upcast else "")
        try:
            self._site(q, cos, sin, core, bindings)
        except SkipSite as exc:
            self.report.left_alone(key_of(core), form, str(exc), larger_form=self.partial or self.upcast)
            return result.fail(str(exc))
        return result

    # -- rewrite ----------------------------------------------------------------------------------
    def _caches(self, op, site: Site) -> tuple[ir.Value, ir.Value, ir.Value | None]:
        memo_key = (site.cos_value, site.sin_value, site.rd)
        found = self.memo.get(memo_key)
        if found is not None:
            return found
        half = site.rd // 2
        if site.cos.kind == "gather":
            graph = site.x.graph
            cos, pos = gather_inputs(op, site.cos, site.x, _fresh_name(graph, f"{site.key}_cos_cache"))
            sin, _ = gather_inputs(op, site.sin, site.x, _fresh_name(graph, f"{site.key}_sin_cache"))
            found = (cos, sin, pos)
        else:
            found = (per_token_value(op, site.cos, site.x, half), per_token_value(op, site.sin, site.x, half), None)
        self.memo[memo_key] = found
        return found

    def rewrite(self, op, q, cos, sin, core, **bindings):
        site = self._site(q, cos, sin, core, bindings)
        cos_v, sin_v, pos = self._caches(op, site)
        interleaved = int(self.form == "interleaved")
        rd_attr = site.rd if site.partial else 0
        name = f"{site.key}/{OP_TYPE}"
        inputs = [cos_v, sin_v] + ([pos] if pos is not None else [])
        if site.layout == "bhsd":
            out = op.op(OP_TYPE, q, *inputs, _domain=DOMAIN, _version=OP_VERSION, _name=name,
                        interleaved=interleaved, num_heads=0, rotary_embedding_dim=rd_attr)
        else:
            flat = op.Reshape(q, op.Constant(value=ir.tensor(np.array([0, 0, -1], dtype=np.int64))))
            y = op.op(OP_TYPE, flat, *inputs, _domain=DOMAIN, _version=OP_VERSION, _name=name,
                      interleaved=interleaved, num_heads=site.heads, rotary_embedding_dim=rd_attr)
            shape = np.array([0, 0, site.heads, -1], dtype=np.int64)
            out = op.Reshape(y, op.Constant(value=ir.tensor(shape)))
        form = self._form() + (f" (partial, {site.rd} of {site.head_dim or '?'})" if site.partial else "")
        if self.upcast:
            form += ", float32 math"
        source = site.cos.source + (" -> [max_pos, rd/2] table + position_ids" if pos is not None
                                    else " -> per-token [B, S, rd/2]")
        self.report.fused(site.key, form, f"{site.layout}, cos/sin {source}")
        return out


STAGES = 3


def rule_variants(cls, report: FusionReport, memo: dict) -> list[tuple[int, pattern.RewriteRule]]:
    """All variants of a fusion rule class with their stage: a stage runs after the stages whose
    patterns contain its pattern (the rewriter visits nodes in order and would otherwise fuse the
    inner core, which comes first, before seeing the larger form)."""
    return [
        (0, cls(report, memo, partial=True, upcast=True).as_rule()),
        (0, cls(report, memo, partial=True).as_rule()),
        (1, cls(report, memo, upcast=True).as_rule()),
        (2, cls(report, memo).as_rule()),
    ]


def _fresh_name(graph: ir.Graph | None, base: str) -> str:
    taken = set(graph.initializers) if graph is not None else set()
    if graph is not None:
        taken |= {v.name for v in graph.inputs}
        for node in graph:
            taken |= {v.name for v in node.outputs if v.name}
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    return name
