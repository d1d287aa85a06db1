"""What the fusion rules share: the report, the analysis of a matched site and its replacement.

A rule (``fuse_*.py``) gives the pattern of a rotation's arithmetic and says which matched values are
the rotated operands and which are cos/sin (``Candidate``). Everything else is common and decided by
running the matched ops (``_site``, ``_probe``): that the operands are the source tensor's channels,
rotate-half or interleaved pairs, the rotated width, the sign of sin, the layout; where cos/sin come
from (``_cos_sin``); and, last, that the ops equal the op contract with those caches on random
inputs (``_verify``). The rewrite is one rope_export::RotaryEmbedding node (plus Reshapes for
[B, S, H, D] tensors).

Variants of each rule (one rule object each): ``partial`` wraps the rotation in
``cat(rotation(q[..., :rd]), q[..., rd:])``; ``upcast`` allows it to be computed in float32 under a
half-precision tensor, ``cast(rotation(cast(q, f32)), q.dtype)``, which is the op contract with
float32 caches.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field, replace

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from rope_export.op.contract import DOMAIN, OP_TYPE, OP_VERSION
from rope_export.passes._cos_sin import (
    Trace,
    TraceError,
    folded_per_token_value,
    gather_inputs,
    graph_per_token_value,
    graph_trace,
    per_token_value,
    table_traces,
    trace,
)
from rope_export.passes._probe import EvaluationFailed, Probe
from rope_export.passes._site import (
    FOLDED,
    Candidate,
    Form,
    SkipSite,
    cast_chain,
    check_dtype,
    classify,
    layout_of,
)
from rope_export.passes._values import dim, dtype_of
from rope_export.passes._verify import verify

__all__ = ["FusionReport", "FuseRotary", "NotASite", "SiteRecord", "SkipSite", "STAGES", "rule_variants"]


@dataclass
class SiteRecord:
    site: str  # the output value of the decomposed rotation (before any partial Concat)
    status: str  # "fused", "left alone", "already fused", "other rotary op"
    form: str = ""  # rotate-half / interleaved (+ pairs, partial, ...)
    detail: str = ""  # fused: layout, cos/sin source; left alone: why


@dataclass
class FusionReport:
    """What ``fuse`` saw: one row per site, fused or left alone (and why)."""

    records: dict[str, SiteRecord] = field(default_factory=dict)
    larger_form_misses: dict[str, str] = field(default_factory=dict)
    found: int | None = None  # decomposed rotations in the input, by the graph's evidence (passes.evidence)
    left: int | None = None  # decomposed rotations in the result, by the same evidence

    @property
    def complete(self) -> bool:
        """No rotation the graph's evidence shows was left decomposed (True when not counted)."""
        return not self.left and (self.found is None or self.num_fused >= self.found)

    def summary(self) -> str:
        """ "N rotation(s) found, M fused" (and how many are left), from the graph's own evidence."""
        if self.found is None:
            return f"fused {self.num_fused} site(s)"
        text = (f"{self.found} rotation(s) found (cos/sin feeding multiply-add pairs), {self.num_fused} fused"
                + (f", {self.left} left decomposed" if self.left else ""))
        if not self.complete:
            text += "; " + self.why_left()
        return text

    def why_left(self) -> str:
        """Where the reasons for rotations left decomposed are: the table's rows, or no rule's."""
        if any(r.status != "fused" for r in self.records.values()):
            return "the table says why each site was left alone"
        return "no fusion rule matched them (their spelling is not one fuse knows; docs/passes.md lists those)"

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
            if site in self.records:
                return  # the inner form's own reason stays
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


class NotASite(Exception):
    """The matched arithmetic is not a rotation of a tensor's channels at all: no report row."""


@dataclass
class Site:
    """A matched rotation, analysed and verified: everything the rewrite needs."""

    key: str
    y: ir.Value  # the value the fused node replaces
    x: ir.Value  # the op's X (the whole head when partial)
    candidate: Candidate
    form: Form
    layout: str  # "bhsd", "bshd", "sbhd" (rewritten as bshd: the op's B and S are the tensor's S and B),
    # or one of _site.FOLDED ("thd", "rows": X reshaped around the node)
    heads: int | None
    cos: Trace
    sin: Trace
    product_rank: int  # rank of cos's product with the channels (4, or 5 for [..., d/2, 1] pairs)
    source_shape: tuple[int, ...]  # the rotated tensor's shape in the probes
    product_shape: tuple[int, ...] = ()  # cos's product with the channels in the probes

    @property
    def partial(self) -> bool:
        return self.form.rd < self.form.width


def key_of(value: ir.Value) -> str:
    return value.name or f"<{value.producer().op_type} output>"


class FuseRotary(pattern.RewriteRuleClassBase, abc.ABC):
    """Base of the fusion rules: ``core`` is the pattern of the rotation (its output named "core"),
    ``candidate`` names the rotated tensor and cos/sin among the matched values."""

    spelling: str = ""  # appended to the form in the report ("pairs", ...)

    def __init__(self, report: FusionReport, memo: dict, partial: bool = False, upcast: bool = False,
                 variant: str = ""):
        suffix = ("-partial" if partial else "") + ("-upcast" if upcast else "")
        super().__init__(name=f"fuse-{type(self).__name__}{variant}{suffix}")
        self.partial, self.upcast = partial, upcast
        self.report, self.memo = report, memo

    def as_rule(self) -> pattern.RewriteRule:
        # remove_nodes=False: the matched nodes are left for the dead-code pass between stages, so a
        # site still fuses when an intermediate value also feeds shape arithmetic (the TorchScript
        # exporter computes slice bounds from Shape(x[..., :rd])).
        return pattern.RewriteRule(self.pattern, self.rewrite, self.check, name=self.name, remove_nodes=False)

    # -- pattern ----------------------------------------------------------------------------------
    @staticmethod
    def _slice(op, x, tag: str):
        return op.Slice(x, pattern.Var(f"{tag}_starts"), pattern.Var(f"{tag}_ends"),
                        pattern.Var(f"{tag}_axes", can_match_none=True),
                        pattern.Var(f"{tag}_steps", can_match_none=True), _outputs=[f"{tag}_out"])

    @abc.abstractmethod
    def core(self, op):
        """The pattern of the rotation (output named "core"), built from pattern.Var inputs."""

    @abc.abstractmethod
    def candidate(self, probe: Probe, bindings: dict) -> Candidate:
        """The rotation's operands among the bindings (y = the core); NotASite when there are none."""

    def pattern(self, op):
        core = self.core(op)
        if self.upcast:
            core = op.Cast(core, _outputs=["down"])
        if self.partial:
            return op.Concat(core, self._slice(op, pattern.Var("q"), "pass"), _outputs=["joined"])
        return core

    # -- check ------------------------------------------------------------------------------------
    def _root(self, bindings: dict) -> ir.Value:
        return bindings["joined"] if self.partial else bindings["down"] if self.upcast else bindings["core"]

    def check(self, context, **bindings) -> pattern.MatchResult:
        result = pattern.MatchResult()
        try:
            self.site(context.model, bindings)
        except NotASite as exc:
            return result.fail(str(exc))
        except SkipSite as exc:
            form = self.spelling or "rotation"
            form += (" (partial)" if self.partial else "") + (" in float32" if self.upcast else "")
            self.report.left_alone(key_of(bindings["core"]), form, str(exc), larger_form=self.partial or self.upcast)
            return result.fail(str(exc))
        return result

    def site(self, model: ir.Model | None, bindings: dict) -> Site:
        """The analysed site of a match (memoized: the rewrite asks again)."""
        root = self._root(bindings)
        memo_key = ("site", self.name, root)
        if memo_key not in self.memo:
            try:
                try:
                    self.memo[memo_key] = self._analyse(self._probe(model), bindings, root)
                except SkipSite as exc:
                    if not isinstance(exc.__cause__, EvaluationFailed):
                        raise
                    self.memo[memo_key] = self._analyse_resized(model, bindings, root, exc)
            except (NotASite, SkipSite) as exc:
                self.memo[memo_key] = exc
        found = self.memo[memo_key]
        if isinstance(found, Exception):
            raise found
        return found

    def _analyse_resized(self, model: ir.Model | None, bindings: dict, root: ir.Value, failure: SkipSite) -> Site:
        """The sizes did not fit together: the site analysed with the inputs' dims sized by axis, then with dims
        sized by the expressions they broadcast against (``Probe.by_axis``, ``Probe.unified``)."""
        for key in ("by_axis", "unified"):
            if f"probe_{key}" not in self.memo:
                self.memo[f"probe_{key}"] = getattr(self._probe(model), key)()
            try:
                return self._analyse(self.memo[f"probe_{key}"], bindings, root)
            except SkipSite as exc:
                if not isinstance(exc.__cause__, EvaluationFailed):
                    raise
        raise failure

    def _probe(self, model: ir.Model | None) -> Probe:
        if "probe" not in self.memo:
            self.memo["probe"] = Probe(model if model is not None else ir.Model(ir.Graph([], [], nodes=[]),
                                                                                  ir_version=10))
        return self.memo["probe"]

    def _analyse(self, probe: Probe, bindings: dict, root: ir.Value) -> Site:
        core = self.candidate(probe, bindings)
        check_dtype(root)
        if self.partial and core.y_perm is not None:
            raise NotASite("a partial join of a rotation written into a transposed buffer")
        if self.partial:
            q = bindings["q"]
            cand = replace(core, y=root, source=q, x=q)
        elif self.upcast:
            if core.flatten_source:
                raise SkipSite("a float32 rotation of pairs with no value in the rotated tensor's shape")
            chain = cast_chain(core.x)
            x = next((v for v in chain if dtype_of(v) == dtype_of(root)), None)
            if x is None:
                raise SkipSite("the float32 rotation does not start from the tensor's own precision")
            source = core.source if core.source in chain[chain.index(x):] else x
            cand = replace(core, y=root, source=source, x=x)
        else:
            cand = core
        form, cos_shape, product_shape, source_shape = classify(probe, cand, self.partial)
        if not self.partial and form.rd != form.width:
            raise SkipSite(f"only {form.rd} of {form.width} channels rotate without a partial split")
        layout, heads = layout_of(cand.x, cos_shape, product_shape)
        cos, sin, note = self._traces(probe, cand, form, layout, len(product_shape))
        if form.sin_sign < 0 and sin.kind == "gather":
            sin = replace(sin, table=-sin.table)
        site = Site(key_of(bindings["core"]), root, cand.x, cand, form, layout, heads, cos, sin, len(product_shape),
                    source_shape, tuple(product_shape))
        try:
            verify(probe, site)
        except SkipSite as exc:
            raise SkipSite(f"{exc}; {note}" if note else str(exc)) from None
        return site

    @staticmethod
    def _traces(probe: Probe, cand: Candidate, form: Form, layout: str, rank: int) -> tuple[Trace, Trace, str]:
        """(cos trace, sin trace, why the structural trace did not apply, or "")."""
        head_axis = 1 if layout == "bhsd" else 2
        if layout == "sbhd" or layout in FOLDED:  # only the values as the site computes them fit the op's tokens
            return (graph_trace(probe, cand.cos, cand.cos_product, layout),
                    graph_trace(probe, cand.sin, cand.cos_product, layout), "")
        dup = None if cand.pairs else ("repeat" if form.interleaved else "cat")
        note = ""
        try:
            tc, ts = trace(cand.cos, dup, form.rd), trace(cand.sin, dup, form.rd)
            if tc.kind == ts.kind and tc.head_axis == ts.head_axis == head_axis and (
                tc.kind != "gather" or tc.positions is ts.positions
            ):
                return tc, ts, ""
            note = "cos and sin come from different kinds of source"
        except TraceError as exc:
            note = str(exc)
        tables = table_traces(probe, cand.cos, cand.sin, rank, layout, form, cand.pairs)
        if tables is not None:
            return (*tables, note)
        return (graph_trace(probe, cand.cos, cand.cos_product, layout),
                graph_trace(probe, cand.sin, cand.cos_product, layout), note)

    # -- rewrite ----------------------------------------------------------------------------------
    def _caches(self, op, site: Site) -> tuple[ir.Value, ir.Value, ir.Value | None]:
        memo_key = ("caches", site.candidate.cos, site.candidate.sin, site.form, site.cos.kind)
        found = self.memo.get(memo_key)
        if found is not None:
            return found
        half = site.form.rd // 2
        if site.cos.kind == "gather":
            graph = site.x.graph
            cos, pos = gather_inputs(op, site.cos, site.x, _fresh_name(graph, f"{site.key}_cos_cache"))
            sin, _ = gather_inputs(op, site.sin, site.x, _fresh_name(graph, f"{site.key}_sin_cache"))
            found = (cos, sin, pos)
        else:
            def build(tr):
                if tr.kind == "graph" and site.layout in FOLDED:
                    return folded_per_token_value(op, tr, site.layout, site.form, site.candidate.pairs)
                if tr.kind == "graph":
                    return graph_per_token_value(op, tr, site.form, site.candidate.pairs)
                return per_token_value(op, tr, site.x, half)

            cos, sin = build(site.cos), build(site.sin)
            found = (cos, op.Neg(sin) if site.form.sin_sign < 0 else sin, None)
        self.memo[memo_key] = found
        return found

    def rewrite(self, op, **bindings):
        site = self.site(None, bindings)
        cos, sin, pos = self._caches(op, site)
        x = site.x
        if site.candidate.flatten_source:  # [..., d/2, 2] -> [..., d]
            source = site.candidate.source
            rank = source.shape.rank()
            shape = op.Shape(source)
            head = op.Slice(shape, op.Constant(value=ir.tensor(np.array([0], dtype=np.int64))),
                            op.Constant(value=ir.tensor(np.array([rank - 2], dtype=np.int64))))
            x = op.Reshape(source, op.Concat(head, op.Constant(value=ir.tensor(np.array([-1], dtype=np.int64))),
                                             axis=0))
            x.dtype = source.dtype
        if dtype_of(x) != dtype_of(site.y):
            x = op.Cast(x, to=dtype_of(site.y))
        cos, sin = (_cache_dtype(op, c, dtype_of(site.y)) for c in (cos, sin))
        rd_attr = site.form.rd if site.partial else 0
        name = f"{site.key}/{OP_TYPE}"
        inputs = [cos, sin] + ([pos] if pos is not None else [])
        def rotary(x, num_heads):
            return op.op(OP_TYPE, x, *inputs, _domain=DOMAIN, _version=OP_VERSION, _name=name,
                         interleaved=int(site.form.interleaved), num_heads=num_heads, rotary_embedding_dim=rd_attr)

        if site.layout == "bhsd":
            out = rotary(x, 0)
        elif site.layout in FOLDED:  # an exact reshape of X to the op's tokens, and back
            if site.layout == "thd":  # [T, H, D] -> [1, T, H*D]; H*D static, so every lowering sees the head size
                hidden = site.heads * site.form.width if site.heads else -1
                flat = op.Reshape(op.Unsqueeze(x, _ints(op, [0])), _ints(op, [0, 0, hidden]))
            else:  # [.., M, D] -> [N, M, D], each row its own token
                tail = op.Slice(op.Shape(x), _ints(op, [-2]), _ints(op, [np.iinfo(np.int64).max]))
                flat = op.Reshape(x, op.Concat(_ints(op, [-1]), tail, axis=0))
            flat.dtype = x.dtype
            out = op.Reshape(rotary(flat, site.heads), op.Shape(x))
        else:
            flat = op.Reshape(x, op.Constant(value=ir.tensor(np.array([0, 0, -1], dtype=np.int64))))
            y = rotary(flat, site.heads)
            out = op.Reshape(y, op.Constant(value=ir.tensor(np.array([0, 0, site.heads, -1], dtype=np.int64))))
        if site.candidate.y_perm is not None:  # the site wrote the rotation into a transposed buffer
            out = op.Transpose(out, perm=list(site.candidate.y_perm))
        self.report.fused(site.key, self._form_text(site), self._detail(site, pos is not None))
        return out

    def _form_text(self, site: Site) -> str:
        form = ("interleaved" if site.form.interleaved else "rotate-half") + (f" {self.spelling}" if self.spelling
                                                                              else "")
        if site.partial:
            form += f" (partial, {site.form.rd} of {dim(site.x, -1) or '?'})"
        if self.upcast:
            form += ", float32 math"
        if site.form.sin_sign < 0:
            form += ", sin sign flipped"
        return form

    @staticmethod
    def _detail(site: Site, with_positions: bool) -> str:
        per_token = {"thd": " -> per-token [1, T, rd/2], X [T, H, D] as [1, T, H*D]",
                     "rows": " -> per-row [N, M, rd/2], X [.., M, D] as [N, M, D] (heads folded into the batch)"}
        source = site.cos.source + (" -> [max_pos, rd/2] table + position_ids" if with_positions
                                    else per_token.get(site.layout, " -> per-token [B, S, rd/2]"))
        return f"{site.layout}, cos/sin {source}; verified numerically"


def _ints(op, values) -> ir.Value:
    return op.Constant(value=ir.tensor(np.array(values, dtype=np.int64)))


def _cache_dtype(op, cache: ir.Value, x_dtype) -> ir.Value:
    """The contract takes caches of X's type or float32."""
    dtype = dtype_of(cache)
    if dtype is None or dtype in (x_dtype, ir.DataType.FLOAT):
        return cache
    return op.Cast(cache, to=ir.DataType.FLOAT)


STAGES = 6  # (partial, float32 math, plain) x (joins ending in a Reshape, the others)


def rule_variants(cls, report: FusionReport, memo: dict, substage: int = 0,
                  **kwargs) -> list[tuple[int, pattern.RewriteRule]]:
    """All variants of a fusion rule class with their stage: a stage runs after the stages whose
    patterns contain its pattern (the rewriter visits nodes in order and would otherwise try the
    inner core, which comes first, before seeing the larger form). ``substage`` 0 is for patterns
    that end in a Reshape around a Concat another rule's pattern ends in."""
    return [
        (substage, cls(report, memo, partial=True, upcast=True, **kwargs).as_rule()),
        (substage, cls(report, memo, partial=True, **kwargs).as_rule()),
        (2 + substage, cls(report, memo, upcast=True, **kwargs).as_rule()),
        (4 + substage, cls(report, memo, **kwargs).as_rule()),
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
