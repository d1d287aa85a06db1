"""The rotary forms: how a rotary function is called, what it computes, and its replacement.

A *form* is one entry of ``FORMS``. It says

* the call convention (``Convention``): which positional arguments are the rotated tensors and
  which carry the angles (``q, k, cos, sin``; ``x, cos, sin``; GPT-J's ``x, sin, cos``; Meta's
  ``xq, xk, freqs_cis``);
* how the caller spells the angles (``angles``): transformers' ``cat(freqs, freqs)`` (``"cat"``),
  ``repeat_interleave(freqs, 2)`` (``"repeat"``), the bare half-width ``freqs`` (``"half"``) or a
  complex ``polar(m, freqs)`` (``"complex"``);
* what the function computes: pairs ``(i, i + rd/2)`` or ``(2i, 2i+1)`` (``interleaved``), the sign
  of sin, whether a partial rotation acts on the leading or trailing channels, and whether the
  rotated pairs come back in rotate-half order (DeepSeek's de-interleaving).

``WRITTEN_FORMS`` are the forms real code is written in (each names who writes it); ``FORMS`` adds
every other combination of convention, angle spelling, pairing and sign, so a user's function of a
new spelling is found too. From that, ``replacement_call`` computes the same thing with one ``torch.ops.rope_export.
rotary_embedding`` call per tensor, and ``probe`` checks numerically that a function computes what
the form says, on random tensors, both layouts ([B, H, S, D] and [B, S, H, D]), whole and partial
heads. Adding a form is adding an entry to ``FORMS``.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rope_export.kernels import torch_op as ops
from rope_export.op.tolerances import tolerance

LAYOUTS = ("bhsd", "bshd")  # [B, H, S, D] (transformers' unsqueeze_dim=1) and [B, S, H, D] (unsqueeze_dim=2)
LAYOUT_PARAMETER = "unsqueeze_dim"  # transformers' name for the layout switch: 1 -> bhsd, 2 -> bshd


class FormError(ValueError):
    """A call the form cannot reproduce (shapes it does not know); the message says which."""


@dataclass(frozen=True)
class Convention:
    """Where the rotated tensors and the angles sit among a rotary function's positional arguments."""

    name: str
    tensors: tuple[int, ...]  # positions of the rotated tensors (a tensor passed as None is not rotated)
    angles: tuple[int, ...]  # positions of (cos, sin), or of (freqs_cis,) for a complex form

    @property
    def arity(self) -> int:
        return max(self.tensors + self.angles) + 1


CONVENTIONS = {
    "q, k, cos, sin": Convention("q, k, cos, sin", (0, 1), (2, 3)),
    "x, cos, sin": Convention("x, cos, sin", (0,), (1, 2)),
    "x, sin, cos": Convention("x, sin, cos", (0,), (2, 1)),
    "xq, xk, freqs_cis": Convention("xq, xk, freqs_cis", (0, 1), (2,)),
}


@dataclass(frozen=True)
class RotaryForm:
    """One way of writing RoPE: its call convention, its angle spelling and what it computes."""

    name: str
    convention: Convention
    angles: str  # "cat" | "repeat" | "half" | "complex"
    interleaved: bool  # the pairs the function rotates: (2i, 2i+1) if True, else (i, i + rd/2)
    negate_sin: bool = False  # rotates by -angle (rotate_half written cat(x2, -x1))
    trailing: bool = False  # a partial rotation acts on the last rd channels, not the first
    to_half_order: bool = False  # rotated pairs (2i, 2i+1) written back as (i, i + rd/2)
    notes: str = ""

    @property
    def tensors_per_call(self) -> int:
        return len(self.convention.tensors)

    @property
    def node_interleaved(self) -> bool:
        """The ``interleaved`` attribute of the nodes the replacement emits."""
        return self.interleaved and not self.to_half_order


def _form(name, convention, angles, interleaved, notes, **kw) -> RotaryForm:
    return RotaryForm(name, CONVENTIONS[convention], angles, interleaved, notes=notes, **kw)


# The forms real code is written in, each with who writes it (tried first, in this order).
WRITTEN_FORMS = (
    _form("rotate-half", "q, k, cos, sin", "cat", False,
          "transformers' Llama apply_rotary_pos_emb: x*cos + rotate_half(x)*sin; partial when cos is narrower "
          "than the head (Phi-3, GPT-NeoX), or sliced by the caller (Phi)"),
    _form("rotate-half-one", "x, cos, sin", "cat", False, "one tensor per call (Gemma 3n, Gemma 4)"),
    _form("rotate-half-half-angles", "q, k, cos, sin", "half", False,
          "cos/sin of half width, x chunked in two halves (gpt-oss)"),
    _form("rotate-half-negated", "q, k, cos, sin", "cat", False,
          "rotate_half written cat(x2, -x1): a rotation by -angle (NanoChat)", negate_sin=True),
    _form("interleaved-cat-angles", "q, k, cos, sin", "cat", True,
          "GLM style: the first half of cat(freqs, freqs) repeat_interleaved, pairs (2i, 2i+1) (GLM, GLM-4, "
          "Helium, ERNIE 4.5)"),
    _form("interleaved-repeat-angles", "q, k, cos, sin", "repeat", True,
          "cos/sin already repeat_interleaved by the rotary module, pairs (2i, 2i+1) (Cohere)"),
    _form("interleaved-to-half-order", "q, k, cos, sin", "cat", True,
          "pairs (2i, 2i+1) written back in rotate-half order (DeepSeek V3 apply_rotary_pos_emb_interleave)",
          to_half_order=True),
    _form("interleaved-one", "x, sin, cos", "half", True,
          "GPT-J / CodeGen: one [B, S, H, rd] tensor, sin before cos, half-width angles"),
    _form("interleaved-one-trailing", "x, cos, sin", "half", True,
          "half-width angles repeat_interleaved, the rotation on the trailing channels (DeepSeek V4)",
          trailing=True),
    _form("complex", "xq, xk, freqs_cis", "complex", True,
          "Meta's view_as_complex(x) * freqs_cis (Llama 4, DeepSeek V2, Meta's reference code)"),
)


def _every_other_spelling():
    """The remaining combinations of convention, angle spelling, pairing and sign (user code writes them too)."""
    written = {(f.convention.name, f.angles, f.interleaved, f.negate_sin) for f in WRITTEN_FORMS
               if not f.trailing and not f.to_half_order}
    for convention in ("q, k, cos, sin", "x, cos, sin", "x, sin, cos"):
        for angles in ("cat", "repeat", "half"):
            for interleaved in (False, True):
                for negate in (False, True):
                    if (convention, angles, interleaved, negate) in written:
                        continue
                    pairs = "interleaved" if interleaved else "rotate-half"
                    name = f"{pairs}{'-negated' if negate else ''} ({convention}; {angles} angles)"
                    yield _form(name, convention, angles, interleaved, "", negate_sin=negate)


FORMS: dict[str, RotaryForm] = {form.name: form for form in (*WRITTEN_FORMS, *_every_other_spelling())}


# -- from the caller's angles to the op's caches ---------------------------------------------

def op_caches(form: RotaryForm, angle_args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(cos, sin, rotary_dim) for the op from the angles as the caller passes them: [.., rd/2] caches."""
    if form.angles == "complex":
        (freqs_cis,) = angle_args
        if torch.is_complex(freqs_cis):
            cos, sin = freqs_cis.real, freqs_cis.imag
        elif freqs_cis.shape[-1] == 2:  # torch.view_as_real of the complex table
            cos, sin = freqs_cis[..., 0], freqs_cis[..., 1]
        else:
            raise FormError(f"freqs_cis must be complex or view_as_real, got shape {list(freqs_cis.shape)}")
        return cos, sin, 2 * cos.shape[-1]
    cos, sin = angle_args
    width = cos.shape[-1]
    if form.angles == "cat":
        cos, sin, rotary_dim = cos[..., : width // 2], sin[..., : width // 2], width
    elif form.angles == "repeat":
        cos, sin, rotary_dim = cos[..., 0::2], sin[..., 0::2], width
    else:  # "half"
        rotary_dim = 2 * width
    return cos, (-sin if form.negate_sin else sin), rotary_dim


def _per_token(cache: torch.Tensor, batch: int) -> torch.Tensor:
    """[S, n] or [1, S, n] (shared by the batch) -> [B, S, n]; [B, S, n] stays; [B, 1, S, n] / [B, S, 1, n]
    drop the 1."""
    if cache.dim() == 4 and 1 in (cache.shape[1], cache.shape[2]):
        cache = cache.squeeze(1) if cache.shape[1] == 1 else cache.squeeze(2)
    if cache.dim() == 2:
        return cache.unsqueeze(0).expand(batch, -1, -1)
    if cache.dim() != 3:
        raise FormError(f"expected cos/sin of shape [B, S, n] or [S, n], got {list(cache.shape)}")
    if cache.shape[0] == 1 and batch != 1:  # shared by the batch: the op takes one row per token
        return cache.expand(batch, -1, -1)
    return cache


def rotate(form: RotaryForm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
           layout: str) -> torch.Tensor:
    """``x`` rotated as the form says, with one rotary op call; ``cos``/``sin`` are the op's [.., rd/2]."""
    if x.dim() != 4:
        raise FormError(f"expected a 4-D tensor ([B, H, S, D] or [B, S, H, D]), got shape {list(x.shape)}")
    head_dim = x.shape[-1]
    if rotary_dim > head_dim or rotary_dim % 2:
        raise FormError(f"rotary dim {rotary_dim} does not fit a head of {head_dim} channels")
    if form.trailing and rotary_dim < head_dim:
        keep = head_dim - rotary_dim
        return torch.cat((x[..., :keep], rotate(form, x[..., keep:], cos, sin, rotary_dim, layout)), dim=-1)
    if form.to_half_order:  # de-interleave first; the rotation is then rotate-half on the permuted channels
        part = x[..., :rotary_dim]
        x = torch.cat((part[..., 0::2], part[..., 1::2], x[..., rotary_dim:]), dim=-1)
    cos, sin = _per_token(cos, x.shape[0]), _per_token(sin, x.shape[0])
    partial = 0 if rotary_dim == head_dim else rotary_dim
    interleaved = form.node_interleaved
    if layout == "bhsd":
        return ops.rotary_embedding(x, cos, sin, None, interleaved, 0, partial)
    heads = x.shape[2]
    return ops.rotary_embedding(x.flatten(2), cos, sin, None, interleaved, heads, partial).view(x.shape)


def layout_of(arguments: dict, fixed_layout: str | None, angles: torch.Tensor | None = None) -> str:
    """The call's layout: from transformers' ``unsqueeze_dim`` argument if the function has one, else fixed.

    ``unsqueeze_dim=0`` (Pixtral) puts cos/sin ``[S, d]`` (or ``[1, S, d]``) at ``[1, S, d]``, which
    broadcasts against ``[B, H, S, D]`` as one row per token: [B, H, S, D]."""
    if LAYOUT_PARAMETER in arguments:
        value = arguments[LAYOUT_PARAMETER]
        if value in (1, -3):
            return "bhsd"
        if value in (2, -2):
            return "bshd"
        if value == 0 and angles is not None and (angles.dim() == 2 or (angles.dim() == 3 and angles.shape[0] == 1)):
            return "bhsd"
        raise FormError(f"unsqueeze_dim={value} is not a layout the op knows (1: [B,H,S,D], 2: [B,S,H,D])")
    return fixed_layout or "bhsd"


def replacement_call(form: RotaryForm, positional: list, arguments: dict, fixed_layout: str | None):
    """What the original returns, computed through the op: ``positional`` are the call's arguments in order."""
    convention = form.convention
    angle_args = tuple(positional[i] for i in convention.angles)
    cos, sin, rotary_dim = op_caches(form, angle_args)
    layout = layout_of(arguments, fixed_layout, angle_args[0])
    outputs = [None if positional[i] is None else rotate(form, positional[i], cos, sin, rotary_dim, layout)
               for i in convention.tensors]
    if len(outputs) == 1:
        return outputs[0]
    if outputs[1] is None:  # k=None: the function rotates q alone (Qwen4-exp style)
        return outputs[0]
    return tuple(outputs)


def rotate_half_qk(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Drop-in for transformers' Llama-style ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``."""
    return replacement_call(FORMS["rotate-half"], [q, k, cos, sin], {LAYOUT_PARAMETER: unsqueeze_dim}, None)


# -- the numeric probe -----------------------------------------------------------------------

@dataclass(frozen=True)
class ProbeResult:
    """A form verified for a function: the layout it has when it takes no unsqueeze_dim, the worst error."""

    form: RotaryForm
    fixed_layout: str | None
    error: float


def _angle_args(form: RotaryForm, theta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The angles as a caller of this form passes them; magnitude 0.9 stands for an attention factor."""
    magnitude = 0.9
    if form.angles == "complex":
        return (torch.polar(torch.full_like(theta, magnitude), theta),)
    if form.angles == "cat":
        full = torch.cat((theta, theta), dim=-1)
    elif form.angles == "repeat":
        full = theta.repeat_interleave(2, dim=-1)
    else:
        full = theta
    return magnitude * full.cos(), magnitude * full.sin()  # a sign-flipped function negates internally


def _place(form: RotaryForm, tensors: list, angles: tuple) -> list:
    convention = form.convention
    args: list = [None] * convention.arity
    for position, tensor in zip(convention.tensors, tensors, strict=True):
        args[position] = tensor
    for position, angle in zip(convention.angles, angles, strict=True):
        args[position] = angle
    return args


def _tensors(form: RotaryForm, layout: str, head_dim: int, generator) -> list[torch.Tensor]:
    batch, seq, heads = 2, 3, (4, 2)
    shapes = [(batch, h, seq, head_dim) if layout == "bhsd" else (batch, seq, h, head_dim) for h in heads]
    return [torch.randn(shape, generator=generator) for shape in shapes[: form.tensors_per_call]]


def difference(got, want) -> float:
    got = got if isinstance(got, tuple | list) else (got,)
    want = want if isinstance(want, tuple | list) else (want,)
    if len(got) != len(want) or not all(isinstance(t, torch.Tensor) for t in (*got, *want)):
        return float("inf")
    if any(g.shape != w.shape or not w.is_floating_point() for g, w in zip(got, want, strict=True)):
        return float("inf")
    return max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want, strict=True))


def _one_probe(form, function, signature, layout, takes_layout, head_dim, rotary_dim, shared_angles, generator):
    """|original - replacement| on one random case, or None when the original refuses these shapes."""
    tensors = _tensors(form, layout, head_dim, generator)
    half = rotary_dim // 2
    positions = torch.randint(0, 500, (3,) if shared_angles else (2, 3), generator=generator).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    theta = positions[..., None] * inv_freq
    args = _place(form, tensors, _angle_args(form, theta))
    kwargs = {LAYOUT_PARAMETER: 1 if layout == "bhsd" else 2} if takes_layout else {}
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
            warnings.simplefilter("ignore")
            want = function(*bound.args, **bound.kwargs)
    except Exception:  # noqa: BLE001 - any refusal of these shapes by the function under test
        return None
    bound.apply_defaults()
    try:
        got = replacement_call(form, list(bound.args)[: form.convention.arity], dict(bound.arguments),
                               None if takes_layout else layout)
    except (FormError, RuntimeError):
        return float("inf")
    return difference(got, want)


def probe(form: RotaryForm, function: Callable) -> ProbeResult | None:
    """Verify that ``function`` computes what ``form`` says, on random inputs; None if it does not.

    The whole-head case must match in at least one layout (each layout is tried when the function
    takes no ``unsqueeze_dim``; with it, both values are tried). In each layout that matches,
    partial heads (cos narrower than the head) must match too or be refused by the function.
    """
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    positional = [p for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < form.convention.arity and not any(
            p.kind == p.VAR_POSITIONAL for p in signature.parameters.values()):
        return None
    takes_layout = LAYOUT_PARAMETER in signature.parameters
    tol = tolerance("op", "float32")
    generator = torch.Generator().manual_seed(0)
    matched, worst = [], 0.0
    for layout in LAYOUTS:
        whole = [_one_probe(form, function, signature, layout, takes_layout, 8, 8, shared, generator)
                 for shared in (False, True)]
        answered = [e for e in whole if e is not None]
        if not answered:
            continue
        if not all(tol.allclose(e, 0.0) for e in answered):
            if takes_layout and layout == "bhsd":
                return None  # transformers' default layout must work
            continue
        partial = _one_probe(form, function, signature, layout, takes_layout, 12, 8, False, generator)
        if partial is not None and not tol.allclose(partial, 0.0):
            return None  # computes something else on partial heads
        matched.append(layout)
        worst = max(worst, *answered, *(() if partial is None else (partial,)))
    if not matched:
        return None
    if takes_layout:
        return ProbeResult(form, None, worst)
    return ProbeResult(form, matched[0], worst)
