"""Count the rotations a module performs in one eager forward, by what they compute.

``count_rotations(module, args, kwargs)`` runs the module once under a ``TorchDispatchMode`` that
follows data flow through every ATen op, independently of any hook, fusion rule or function name:

* **trig values**: results of ``aten.cos``/``sin``/``polar`` (of anything but activations), and
  leaf tensors (inputs, buffers, plain tensor attributes) that are numerically trig tables: a
  stacked ``[..., 2]`` or concatenated ``[c | s]`` table with ``c² + s²`` constant, a complex table
  of constant magnitude, or two same-shaped tensors ``(c, s)`` with ``c² + s²`` constant (a cos/sin
  pair handed in as ``position_embeddings``). Views, casts, indexing by positions, products with
  scalars and products of trig values stay trig.
  Tables no module owns (a module-level ``lru_cache``, a dict, a global: made before the forward, so no
  trig op runs in it) are tested where they are used: an activation times such a constant is a
  *factor*, and two factors summed are a rotation only if their constants satisfy cos² + sin² = const
  there (``tables.py`` holds the numeric tests; rows of zeros, padding positions, are allowed).
* **terms**: a trig value times a non-trig tensor (``x * cos``, ``rotate_half(x) * sin``).
* **rotations**: the sum or difference of two terms, or a complex product with a trig value, or
  one call of rope_export's own op. Terms joined along the last axis by ``cat``/``stack`` (or
  copied into slices of one tensor) belong to one rotation: the pair-by-pair forms
  ``stack((x1*c - x2*s, x1*s + x2*c), -1)`` count once.

A rotation whose terms carry a second non-trig, non-scalar factor (``x * cos * scale`` with a
per-position scale: xPos) is counted and flagged ``scaled``: it is not plain RoPE and no fusion
rule rewrites it. Each rotation is attributed to the innermost ``nn.Module`` running when it was
made (module hooks), and to a layer index: the first integer in that module's path.

Not counted (by design): sinusoidal embeddings added to activations (a sum with a non-term), a
gated product without trig (SwiGLU), trig functions of activations (Snake/SIREN-style), and
rotations written as a matrix product with a rotation matrix.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from rope_export.detect.tables import _pair_table, _pythagorean, _single_table, _varies

# ATen ops (schema names without the overload) that move or retype data without computing:
# they carry a rotation's identity, and keep a trig value trig or a term a term.
SHAPE_OPS = frozenset(
    "aten::" + name
    for name in (
        "view _unsafe_view reshape _reshape_alias unsqueeze squeeze permute transpose t expand clone "
        "contiguous _to_copy to alias detach lift_fresh slice select narrow split split_with_sizes unbind "
        "chunk cat stack view_as_real view_as_complex flatten unflatten movedim neg repeat "
        "index_select expand_as type_as unsafe_split"
    ).split()
)
JOIN_OPS = frozenset({"aten::cat", "aten::stack"})
RESHAPES = frozenset({"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::view_as_real"})
TRIG_SOURCES = frozenset({"aten::cos", "aten::sin", "aten::cos_", "aten::sin_"})
PRODUCTS = frozenset({"aten::mul", "aten::mul_", "aten::div", "aten::div_"})
SUMS = frozenset({"aten::add", "aten::add_", "aten::sub", "aten::sub_", "aten::rsub"})
OWN_OP = "rope_export::rotary_embedding"



@dataclass(frozen=True)
class RotationSite:
    """One rotated tensor: where it was rotated and how."""

    module_path: str  # innermost module running when the rotation was made ("" = the root)
    layer: int | None  # first integer of module_path (the layer of a ModuleList), None if none
    shape: tuple[int, ...]  # the rotated tensor (after its halves/pairs were joined)
    form: str  # "real" (x*cos ± r(x)*sin), "complex" (complex product) or "rope_export op"
    scaled: bool = False  # magnitude varies with position/frequency (xPos-style): not plain RoPE

    def describe(self) -> str:
        where = self.module_path or "<root>"
        kind = "xPos-style scaled rotation" if self.scaled else f"{self.form} rotation"
        return f"{where}: {kind} of {list(self.shape)}"


@dataclass
class RotationCensus:
    """The rotations of one eager forward."""

    sites: list[RotationSite] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # anything that makes the count less than certain
    # the forward's tensor inputs (flattened, in order) that are cos/sin tables the caller computed (a pipeline's
    # rotary tables, a block's position_embeddings): the fusion is told, as the graph alone cannot show it
    table_inputs: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return len(self.sites)

    @property
    def plain(self) -> list[RotationSite]:
        """Rotations a RoPE op can replace (not scaled)."""
        return [s for s in self.sites if not s.scaled]

    @property
    def scaled(self) -> list[RotationSite]:
        return [s for s in self.sites if s.scaled]

    def by_layer(self, sites: list[RotationSite] | None = None) -> dict[int | None, int]:
        return dict(Counter(s.layer for s in (self.sites if sites is None else sites)))

    def by_module(self) -> dict[str, int]:
        return dict(Counter(s.module_path for s in self.sites))

    def as_text(self) -> str:
        lines = [f"{self.total} rotation(s) in one eager forward ({len(self.scaled)} scaled)"]
        lines += [f"  {s.describe()}" for s in self.sites]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


class WitnessError(RuntimeError):
    """The module's forward failed while being counted; the message names the module's error."""


# -- tags ---------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class _Tag:
    kind: str = "other"  # "trig", "term" or "other"
    act: bool = False  # derived from activations (float inputs, embeddings)
    scaled: bool = False  # trig with a non-uniform magnitude, or a term with a second factor
    factors: int = 0  # term: non-trig, non-scalar factors multiplied in
    rots: frozenset = frozenset()  # rotation ids this value carries (through shape ops only)
    trig: torch.Tensor | None = None  # term: its trig factor (two terms rotate only if c² + s² is constant)


OTHER = _Tag()
ACT = _Tag(act=True)
TRIG = _Tag(kind="trig")
SCALED_TRIG = _Tag(kind="trig", scaled=True)
# "term": a trig value times another tensor; "factor": an activation times a constant tensor not known
# to be trig (a table made before the forward and held where no module owns it: a global, a dict, an
# lru_cache): two factors summed are a rotation only if their constants prove cos² + sin² = const there.
TERMS = ("term", "factor")


def _is_scalar(t) -> bool:
    return not isinstance(t, torch.Tensor) or t.numel() <= 1


def _floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


# -- the mode ------------------------------------------------------------------------------------

class _Witness(TorchDispatchMode):
    def __init__(self, root: nn.Module):
        super().__init__()
        self.tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.known_params: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.stack: list[nn.Module] = [root]
        self.names = {id(m): name for name, m in reversed(list(root.named_modules(remove_duplicate=False)))}
        self.children = {id(m): {id(c): n for n, c in reversed(list(m.named_children()))} for m in root.modules()}
        self.parent: dict[int, int] = {}
        self.events: dict[int, dict] = {}
        self.notes: list[str] = []

    # union-find over rotation ids
    def find(self, i: int) -> int:
        while self.parent.get(i, i) != i:
            i = self.parent[i]
        return i

    def union(self, ids) -> int:
        roots = sorted({self.find(i) for i in ids})
        for r in roots[1:]:
            self.parent[r] = roots[0]
        return roots[0]

    def path(self) -> str:
        parts: list[str] = []
        for parent, child in zip(self.stack, self.stack[1:], strict=False):
            name = self.children.get(id(parent), {}).get(id(child))
            if name is None:  # called by a module that does not own it: use its own name
                parts = [self.names.get(id(child), type(child).__name__)]
            else:
                parts.append(name)
        return ".".join(p for p in parts if p)

    def new_event(self, out: torch.Tensor, form: str, scaled: bool) -> _Tag:
        i = len(self.events)
        self.events[i] = {"path": self.path(), "shape": tuple(out.shape), "numel": _real_numel(out), "form": form,
                          "scaled": scaled}
        self.parent[i] = i
        return _Tag(kind="other", act=True, rots=frozenset({i}))

    # leaves: tensors the mode has not seen produced
    def tag_of(self, t: torch.Tensor) -> _Tag:
        tag = self.tags.get(t)
        if tag is None:
            if t in self.known_params or not _floating(t):
                tag = OTHER
            else:
                tag = TRIG if _single_table(t) else OTHER
            self.tags[t] = tag
        return tag

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.observe(func, args, kwargs, out)
        return out

    def observe(self, func, args, kwargs, out) -> None:
        name = func._schema.name
        flat_in, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat_in if isinstance(t, torch.Tensor)]
        tags = [self.tag_of(t) for t in tensors]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs:
            return
        tag = self.rule(name, func, args, tensors, tags, outs[0])
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            tag = self.mutated(name, args, tag)  # an in-place op returns the tensor it wrote
        for t in outs:
            self.tags[t] = tag
        self.update_shapes(name, tag, outs[0])

    def rule(self, name, func, args, tensors, tags, out) -> _Tag:
        act = any(t.act for t in tags)
        if name == OWN_OP:
            return self.new_event(out, "rope_export op", False)
        if name in TRIG_SOURCES:
            return ACT if act else TRIG
        if name == "aten::polar":
            magnitude = tensors[0]
            scaled = _varies(magnitude.detach())
            return ACT if tags[1].act else _Tag(kind="trig", scaled=scaled)
        if name == "aten::embedding":
            return ACT
        if name in PRODUCTS and len(args) >= 2:
            return self.product(name, args, out, act)
        if name in SUMS and len(args) >= 2:
            a, b = (self.tag_of(x) if isinstance(x, torch.Tensor) else OTHER for x in args[:2])
            if a.kind in TERMS and b.kind in TERMS:
                strict = "factor" in (a.kind, b.kind)  # a table not known before: proven here or not at all
                kind = _pythagorean(a.trig, b.trig, strict)
                if kind is not None:
                    scaled = kind == "rows" or a.factors > 1 or b.factors > 1 or a.scaled or b.scaled
                    return self.new_event(out, "real", scaled)
        return self.propagate(name, func, args, tensors, tags, act)

    def product(self, name, args, out, act) -> _Tag:
        a, b = args[0], args[1]
        ta = self.tag_of(a) if isinstance(a, torch.Tensor) else OTHER
        tb = self.tag_of(b) if isinstance(b, torch.Tensor) else OTHER
        divide = name.startswith("aten::div")
        # a complex product with a trig value is a rotation by itself
        if not divide and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_complex() \
                and b.is_complex() and (ta.kind == "trig") != (tb.kind == "trig") and "term" not in (ta.kind, tb.kind):
            trig = ta if ta.kind == "trig" else tb
            return self.new_event(out, "complex", trig.scaled)
        for index, (first, second, other) in enumerate(((ta, tb, b), (tb, ta, a))):
            if divide and index == 1:
                break  # x / trig is not a term
            if first.kind == "trig" and second.kind == "trig":
                return _Tag(kind="trig", scaled=first.scaled or second.scaled)
            if first.kind == "trig" and _is_scalar(other):
                return first
            # an activation tagged "factor" (times a constant such as Gemma's 1 + norm weight) is still an
            # activation: times a trig value it is a term
            if first.kind == "trig" and second.kind in ("other", "factor"):
                trig = a if index == 0 else b
                return _Tag(kind="term", act=act, scaled=first.scaled, factors=1, trig=trig)
            if first.kind == "term" and (_is_scalar(other) or second.kind == "trig"):
                return first
            if first.kind == "term" and second.kind in ("other", "factor"):
                return _Tag(kind="term", act=act, scaled=first.scaled, factors=first.factors + 1, trig=first.trig)
            if first.kind == "factor" and _is_scalar(other):
                return first
        if not divide and "factor" not in (ta.kind, tb.kind):
            for first, second, table in ((ta, tb, b), (tb, ta, a)):
                if self.unknown_table(second, table) and first.act and first.kind == "other":
                    return _Tag(kind="factor", act=True, factors=1, trig=table)
        return _Tag(act=act)

    def unknown_table(self, tag: _Tag, t) -> bool:
        """A constant tensor that may be a cos or sin table: floating, not derived from activations, not a weight."""
        return (isinstance(t, torch.Tensor) and tag.kind == "other" and not tag.act and not tag.rots
                and t.is_floating_point() and not _is_scalar(t) and t not in self.known_params)

    def propagate(self, name, func, args, tensors, tags, act) -> _Tag:
        relevant = [tg for t, tg in zip(tensors, tags, strict=True) if _floating(t) and not _is_scalar(t)]
        relevant = relevant or [tg for t, tg in zip(tensors, tags, strict=True) if _floating(t)]
        rots = frozenset().union(*(tg.rots for tg in tags)) if name in SHAPE_OPS else frozenset()
        if rots and name in JOIN_OPS and len(rots) > 1 and self.joins_last_axis(name, args):
            rots = frozenset({self.union(rots)})
        kinds = {tg.kind for tg in relevant}
        if relevant and kinds == {"trig"}:
            return _Tag(kind="trig", scaled=any(tg.scaled for tg in relevant))
        if relevant and name in SHAPE_OPS and kinds == {"factor"}:
            return relevant[0]
        if relevant and name in SHAPE_OPS and kinds <= {"term", "trig"} and "term" in kinds:
            terms = [tg for tg in relevant if tg.kind == "term"]
            return _Tag(kind="term", act=act, scaled=any(tg.scaled for tg in terms),
                        factors=max(tg.factors for tg in terms), trig=terms[0].trig)
        return _Tag(act=act, rots=rots)

    @staticmethod
    def joins_last_axis(name: str, args) -> bool:
        tensors = args[0] if args else []
        dim = args[1] if len(args) > 1 else 0
        if not tensors or not isinstance(tensors[0], torch.Tensor):
            return False
        rank = tensors[0].dim() + (1 if name == "aten::stack" else 0)
        return dim % max(rank, 1) == rank - 1

    def mutated(self, name: str, args, tag: _Tag) -> _Tag:
        """In-place ops: the mutated tensor gets the result's tag (returned), a copy the copied value's; a copy
        into a last-axis slice of a tensor joins that tensor's rotations (``out[..., ::2] = y1; out[..., 1::2] =
        y2``), and a table copied into a constant buffer makes the buffer a table."""
        dst = args[0]
        if name == "aten::copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            tag = self.tag_of(args[1])
            base = dst._base
            held = self.tags.get(base, OTHER) if base is not None else None
            if tag.kind == "trig" and held is not None and (held.kind == "trig" or (
                    held.kind == "other" and not held.act and not held.rots)):
                self.tags[base] = tag  # a table written into a constant buffer (zeros: rows of padding positions)
            if tag.rots and base is not None and base.shape[:-1] == dst.shape[:-1]:
                old = self.tags.get(base) or OTHER
                rots = old.rots | tag.rots
                rots = frozenset({self.union(rots)}) if len(rots) > 1 else rots
                self.tags[base] = _Tag(act=True, rots=rots)
                root = self.find(next(iter(rots)))
                self.events[root].update(shape=tuple(base.shape), numel=_real_numel(base))
        self.tags[dst] = tag
        return tag

    def update_shapes(self, name: str, tag: _Tag, out: torch.Tensor) -> None:
        """A rotation's shape follows its joins and pure reshapes (same size), not expands or copies."""
        if len(tag.rots) != 1 or name not in SHAPE_OPS:
            return
        event = self.events[self.find(next(iter(tag.rots)))]
        numel = _real_numel(out)
        if (name in JOIN_OPS and numel >= event["numel"]) or (
            name in RESHAPES and numel == event["numel"] and (out.dim() == 4 or len(event["shape"]) != 4)
        ):
            event.update(shape=tuple(out.shape), numel=numel)

    def census(self) -> RotationCensus:
        groups: dict[int, dict] = {}
        for i, event in self.events.items():
            root = self.find(i)
            if root not in groups:
                groups[root] = dict(self.events[root])
            groups[root]["scaled"] = groups[root]["scaled"] or event["scaled"]
        sites = [
            RotationSite(g["path"], layer_of(g["path"]), g["shape"], g["form"], g["scaled"])
            for _, g in sorted(groups.items())
        ]
        return RotationCensus(sites, list(self.notes))


def _real_numel(t: torch.Tensor) -> int:
    return t.numel() * (2 if t.is_complex() else 1)


def layer_of(path: str | None) -> int | None:
    """The first integer component of a module path (``model.layers.3.self_attn`` -> 3), or None."""
    if path is None:
        return None
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", path)
    return int(match.group(1)) if match else None


# A module whose forward takes positions as float tensors (diffusers' image ids, LTX-Video's fractional frame
# coordinates) names them here: the indices of its tensor inputs, in order, that are positions. Trig values of
# them are tables, as those of integer positions are; any other float input is an activation.
POSITION_INPUTS = "rope_export_position_inputs"


# -- leaves known before the forward ---------------------------------------------------------------

def _owned_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Buffers, frozen parameters and plain tensor attributes of every submodule."""
    found: list[torch.Tensor] = []
    for sub in module.modules():
        found += [b for b in sub._buffers.values() if b is not None]
        found += [p for p in sub._parameters.values() if p is not None and not p.requires_grad]
        found += [v for v in vars(sub).values() if isinstance(v, torch.Tensor)]
    return found


def _classify_leaves(witness: _Witness, module: nn.Module, inputs: list[torch.Tensor]) -> None:
    for p in module.parameters():
        if p.requires_grad:
            witness.known_params[p] = True  # trainable weights are never trig tables
    owned = _owned_tensors(module)
    candidates = [t for t in inputs + owned if _floating(t)]
    seen: set[int] = set()
    unpaired: dict[tuple, list[torch.Tensor]] = {}
    for t in candidates:
        if id(t) in seen:
            continue
        seen.add(id(t))
        if _single_table(t):
            witness.tags[t] = TRIG
            continue
        if t.is_floating_point() and t.numel() >= 2:
            unpaired.setdefault(tuple(t.shape), []).append(t)
    for group in unpaired.values():
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                kind = _pair_table(a, b)
                if kind is not None:  # "rows": a padding row that is not zero, a per-position scale
                    witness.tags[a] = witness.tags[b] = TRIG if kind == "unit" else SCALED_TRIG
    for t in inputs:
        if t not in witness.tags:
            witness.tags[t] = ACT if _floating(t) else OTHER
    for i in getattr(module, POSITION_INPUTS, ()):  # float positions the module declares: not activations
        witness.tags[inputs[i]] = OTHER


# -- entry point -------------------------------------------------------------------------------------

def count_rotations(module: nn.Module, args=(), kwargs=None) -> RotationCensus:
    """Run ``module(*args, **kwargs)`` once (no grad) and return the rotations it performed.

    The module's outputs are discarded; its state is left as it was, except what its own forward
    changes (e.g. a KV cache object passed in ``kwargs``).
    """
    kwargs = kwargs or {}
    if not isinstance(args, tuple):
        args = (args,)
    witness = _Witness(module)
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    _classify_leaves(witness, module, inputs)
    handles = []
    for sub in {id(m): m for m in module.modules()}.values():
        if sub is module:
            continue
        handles.append(sub.register_forward_pre_hook(lambda m, a: witness.stack.append(m)))
        handles.append(sub.register_forward_hook(lambda m, a, o: _pop(witness, m), always_call=True))
    try:
        with torch.no_grad(), witness:
            module(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the module's own error, named
        raise WitnessError(f"the module's forward failed while counting rotations: {type(exc).__name__}: {exc}") \
            from exc
    finally:
        for h in handles:
            h.remove()
    census = witness.census()
    census.table_inputs = tuple(i for i, t in enumerate(inputs) if witness.tags.get(t) is TRIG)
    return census


def _pop(witness: _Witness, module: nn.Module) -> None:
    if len(witness.stack) > 1 and witness.stack[-1] is module:
        witness.stack.pop()
