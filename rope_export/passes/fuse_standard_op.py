"""Fusion rule: adopt ``ai.onnx`` RotaryEmbedding-23 nodes as rope_export::RotaryEmbedding.

torch.onnx's dynamo exporter at opset >= 23 already rewrites many rotate-half sites into the
standard op (its optimizer runs onnxscript's opset-23 rotary fusion). The rope_export op has the
standard op's semantics plus two extensions (float32 caches under half X, pass-through for
positions outside the cache), so adoption is a change of domain: same inputs, same attributes.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from rope_export.op.contract import DOMAIN, OP_TYPE, OP_VERSION
from rope_export.passes._fuse_base import STAGES, FusionReport
from rope_export.passes._lower_base import SiteError, read_site

KNOWN_ATTRIBUTES = {"interleaved", "num_heads", "rotary_embedding_dim"}
FORM = "ai.onnx RotaryEmbedding-23"


class AdoptStandardRotary(pattern.RewriteRuleClassBase):
    def __init__(self, report: FusionReport):
        super().__init__(name="fuse-adopt-standard-rotary")
        self.report = report

    def pattern(self, op, x, cos, sin):
        position_ids = pattern.Var("position_ids", can_match_none=True)
        return op.RotaryEmbedding(x, cos, sin, position_ids, _domain="", _outputs=["y"])

    def check(self, context, y, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        node = y.producer()
        unknown = sorted(set(node.attributes) - KNOWN_ATTRIBUTES)
        try:
            if unknown:
                raise SiteError(f"unknown attributes {unknown}")
            read_site(node)
        except SiteError as exc:
            self.report.left_alone(y.name or "?", FORM, f"kept as is: {exc}")
            return result.fail(str(exc))
        return result

    def rewrite(self, op, y, **_):
        node = y.producer()
        site = read_site(node)
        inputs = [site.x, site.cos, site.sin] + ([site.position_ids] if site.position_ids is not None else [])
        self.report.fused(y.name or "?", FORM, "renamed to rope_export::RotaryEmbedding (same semantics; positions "
                                               "outside the cache now pass their token through)")
        return op.op(OP_TYPE, *inputs, _domain=DOMAIN, _version=OP_VERSION, _name=node.name or None,
                     **site.attrs.as_onnx_attributes())

    def as_rule(self) -> pattern.RewriteRule:
        return pattern.RewriteRule(self.pattern, self.rewrite, self.check, name=self.name)


def rules(report, memo) -> list[tuple[int, pattern.RewriteRule]]:
    del memo
    return [(STAGES - 1, AdoptStandardRotary(report).as_rule())]
