"""Meta-style complex RoPE through the rotary op, and the reversible patching both hooks use.

Meta's LLaMA reference code rotates with complex numbers::

    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)            # precompute_freqs_cis
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)            # apply_rotary_emb

That is RoPE on interleaved pairs (2i, 2i+1) with ``cos = freqs_cis.real`` and
``sin = freqs_cis.imag``. torch.onnx cannot export complex tensors, so this module offers:

* ``apply_rotary_emb(xq, xk, freqs_cis)``: a drop-in replacement for Meta's function that calls
  ``rope_export::RotaryEmbedding`` once per tensor (``interleaved=1``). It accepts ``freqs_cis``
  complex (eager) or as ``torch.view_as_real(freqs_cis)`` (``[..., D/2, 2]`` float: what the hook
  below stores in the model so that nothing complex is left to export).
* ``meta_rope_hooked(model)``: a context manager that swaps the user's module-level
  ``apply_rotary_emb`` for the drop-in and stores every complex tensor of the model (the
  ``freqs_cis`` buffer or attribute) in its ``view_as_real`` form; everything is restored on exit,
  also when the body raises.
* ``freqs_cis_to_caches(freqs_cis)``: the float32 ``[max_pos, D/2]`` cos/sin caches of the op.
* ``RotaryWithPositions``: a drop-in rotary module called as ``rope(x, input_pos)`` that keeps
  those caches and passes the positions to the op; ``swapped_modules`` puts it in place of a
  user's rotary submodule for the duration of an export.

``patched`` (set attributes, restore them on exit) is the one mechanism every hook here and in
``rope_export.hf`` uses, so that no global state outlives a ``with`` block.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from rope_export.kernels import torch_op as ops

_MISSING = object()


class MetaRopeError(ValueError):
    """A Meta-style module that the hook cannot handle; the message names the fix."""


# -- reversible patching ---------------------------------------------------------------------

@contextlib.contextmanager
def patched(changes: Iterable[tuple[object, str, object]]) -> Iterator[None]:
    """Set ``setattr(obj, name, value)`` for each change; undo them all, newest first, on exit.

    An attribute that did not exist before is deleted again; one that did gets its original object
    back (not a copy), also when the body raises.
    """
    undo: list[tuple[object, str, object]] = []
    try:
        for obj, name, value in changes:
            undo.append((obj, name, _own_value(obj, name)))
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, original in reversed(undo):
            if original is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
            else:
                setattr(obj, name, original)


def _own_value(obj: object, name: str) -> object:
    """The object's own value of ``name`` (not one inherited from its class), or _MISSING."""
    try:
        return vars(obj).get(name, _MISSING)
    except TypeError:  # no __dict__
        return getattr(obj, name, _MISSING)


@contextlib.contextmanager
def swapped_modules(model: nn.Module, replacements: dict[str, nn.Module]) -> Iterator[None]:
    """Replace submodules by dotted name (``"layers.0.attention.rope"``) inside the block only."""
    changes = []
    for name, new in replacements.items():
        parent_name, _, child = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            model.get_submodule(name)
        except AttributeError as exc:
            raise MetaRopeError(f"the model has no submodule {name!r}: {exc}") from None
        changes.append((parent._modules, child, new))
    with dict_items_patched(changes):
        yield


@contextlib.contextmanager
def dict_items_patched(changes: list[tuple[dict, str, object]]) -> Iterator[None]:
    undo = []
    try:
        for mapping, key, value in changes:
            undo.append((mapping, key, mapping.get(key, _MISSING)))
            mapping[key] = value
        yield
    finally:
        for mapping, key, original in reversed(undo):
            if original is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = original


# -- freqs_cis <-> cos/sin -------------------------------------------------------------------

def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """Meta's ``precompute_freqs_cis`` (complex64 ``[end, dim/2]``), for tests and examples."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def _cos_sin(freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) float32 from complex ``freqs_cis`` or its ``view_as_real`` form ``[..., 2]``."""
    if torch.is_complex(freqs_cis):
        return freqs_cis.real.float(), freqs_cis.imag.float()
    if freqs_cis.shape[-1] != 2:
        raise MetaRopeError(
            f"freqs_cis must be complex [..., D/2] or its torch.view_as_real form [..., D/2, 2], got a real tensor "
            f"of shape {list(freqs_cis.shape)}"
        )
    return freqs_cis[..., 0].float(), freqs_cis[..., 1].float()


def freqs_cis_to_caches(freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta's ``freqs_cis`` ([max_pos, D/2] complex, or its view_as_real) as the op's float32 caches.

    The caches are ``[max_pos, D/2]`` cos and sin, for the op with ``position_ids`` and
    ``interleaved=1``; ``RotaryWithPositions.from_freqs_cis`` builds a module around them.
    """
    cos, sin = _cos_sin(freqs_cis)
    if cos.dim() != 2:
        raise MetaRopeError(f"freqs_cis must be [max_pos, D/2], got shape {list(cos.shape)}")
    return cos.contiguous(), sin.contiguous()


# -- the drop-in -----------------------------------------------------------------------------

def rotate_bshd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotate ``x`` [B, S, H, D] by per-token cos/sin ([S, rd/2] or [B, S, rd/2]): one op call.

    ``x`` is handed to the op as 3-D [B, S, H*D] (``num_heads=H``), so no transpose is exported.
    """
    if x.dim() != 4:
        raise MetaRopeError(f"expected x as [batch, seq, heads, head_dim], got shape {list(x.shape)}")
    batch, _, heads, head_dim = x.shape
    if cos.dim() == 2:  # one row per position, shared by the batch
        cos, sin = cos.unsqueeze(0).expand(batch, -1, -1), sin.unsqueeze(0).expand(batch, -1, -1)
    rotary_dim = 2 * cos.shape[-1]
    rotated = ops.rotary_embedding(
        x.flatten(2), cos, sin, None, interleaved, heads, 0 if rotary_dim == head_dim else rotary_dim
    )
    return rotated.view(x.shape)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in replacement of Meta's ``apply_rotary_emb``: one rotary op per tensor.

    ``xq`` [B, S, Hq, D], ``xk`` [B, S, Hk, D]; ``freqs_cis`` complex [S, D/2] (Meta's slice of
    the precomputed table) or [B, S, D/2], or either as ``torch.view_as_real`` (a trailing 2).
    Returns tensors of the inputs' dtypes, rotated in float32 (as Meta's code does).
    """
    cos, sin = _cos_sin(freqs_cis)
    return rotate_bshd(xq, cos, sin), rotate_bshd(xk, cos, sin)


class RotaryWithPositions(nn.Module):
    """A rotary module called as ``rope(x, input_pos)``, backed by float32 ``[max_pos, rd/2]`` caches.

    ``x`` is ``[B, S, H, D]`` (``layout="bshd"``, Meta / torchtune) or ``[B, H, S, D]``
    (``"bhsd"``, transformers); ``input_pos`` is ``[B, S]`` or ``[S]`` int64 (default
    ``0..S-1``). The positions go into the op, which gathers the cache rows (positions outside the
    cache pass the token through, as the op contract says).
    """

    def __init__(self, cos_cache: torch.Tensor, sin_cache: torch.Tensor, *, interleaved: bool = True,
                 layout: str = "bshd", rotary_dim: int = 0):
        super().__init__()
        if layout not in ("bshd", "bhsd"):
            raise MetaRopeError(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
        if cos_cache.shape != sin_cache.shape or cos_cache.dim() != 2:
            raise MetaRopeError(
                f"cos/sin caches must both be [max_pos, rd/2], got {list(cos_cache.shape)} and {list(sin_cache.shape)}"
            )
        self.interleaved, self.layout, self.rotary_dim = bool(interleaved), layout, int(rotary_dim)
        self.register_buffer("cos_cache", cos_cache.float().contiguous(), persistent=False)
        self.register_buffer("sin_cache", sin_cache.float().contiguous(), persistent=False)

    @classmethod
    def from_freqs_cis(cls, freqs_cis: torch.Tensor, layout: str = "bshd") -> RotaryWithPositions:
        """From Meta's complex table (interleaved pairs)."""
        return cls(*freqs_cis_to_caches(freqs_cis), interleaved=True, layout=layout)

    def _apply(self, fn, recurse=True):
        # .half() on the model must not round the caches (float32 caches are allowed under fp16 X).
        caches = {name: self._buffers[name] for name in ("cos_cache", "sin_cache")}
        super()._apply(fn, recurse)
        for name, original in caches.items():
            self._buffers[name] = original.to(device=self._buffers[name].device)
        return self

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 4:
            raise MetaRopeError(f"expected 4-D x ({self.layout}), got shape {list(x.shape)}")
        seq_axis = 1 if self.layout == "bshd" else 2
        batch, seq = x.shape[0], x.shape[seq_axis]
        if input_pos is None:
            input_pos = torch.arange(seq, device=x.device)
        if input_pos.dim() == 1:
            input_pos = input_pos.unsqueeze(0).expand(batch, -1)
        input_pos = input_pos.long()
        if self.layout == "bhsd":
            return ops.rotary_embedding(x, self.cos_cache, self.sin_cache, input_pos, self.interleaved, 0,
                                        self.rotary_dim)
        heads = x.shape[2]
        rotated = ops.rotary_embedding(x.flatten(2), self.cos_cache, self.sin_cache, input_pos, self.interleaved,
                                       heads, self.rotary_dim)
        return rotated.view(x.shape)


# -- the hook --------------------------------------------------------------------------------

@dataclass
class MetaHook:
    """What ``meta_rope_hooked`` changed (all of it undone on exit)."""

    functions: list[str] = field(default_factory=list)  # "package.module.apply_rotary_emb"
    tensors: list[str] = field(default_factory=list)  # "layers.0.freqs_cis" stored as view_as_real


def _python_modules_defining(model: nn.Module, function: str) -> list[types.ModuleType]:
    found: dict[str, types.ModuleType] = {}
    for sub in model.modules():
        module = sys.modules.get(type(sub).__module__)
        if module is not None and callable(getattr(module, function, None)):
            found[module.__name__] = module
    return list(found.values())


def _complex_tensors(model: nn.Module) -> list[tuple[str, nn.Module, str, bool]]:
    """(qualified name, owner module, attribute, is_buffer) for every complex tensor the model holds."""
    out = []
    for prefix, sub in model.named_modules():
        for name, param in sub._parameters.items():
            if param is not None and torch.is_complex(param):
                raise MetaRopeError(
                    f"{prefix + '.' if prefix else ''}{name} is a complex *parameter*; make it a buffer or a plain "
                    "attribute (freqs_cis is a constant), or convert it with freqs_cis_to_caches"
                )
        for name, buf in sub._buffers.items():
            if buf is not None and torch.is_complex(buf):
                out.append((f"{prefix + '.' if prefix else ''}{name}", sub, name, True))
        for name, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and torch.is_complex(value):
                out.append((f"{prefix + '.' if prefix else ''}{name}", sub, name, False))
    return out


@contextlib.contextmanager
def meta_rope_hooked(
    model: nn.Module,
    *,
    function: str = "apply_rotary_emb",
    modules: Iterable[types.ModuleType] | None = None,
) -> Iterator[MetaHook]:
    """Make a Meta-style model export with one rotary op per rotated tensor, inside the block only.

    * every Python module that defines ``function`` (default: those of the model's own classes,
      or ``modules``) gets ``rope_export.exporting.meta.apply_rotary_emb`` under that name;
    * every complex tensor the model holds (buffer or plain attribute, e.g. ``freqs_cis``) is
      stored as ``torch.view_as_real`` of itself, so slicing it by position exports as real ops.

    On exit (also on error) the functions and tensors are the original objects again.
    """
    targets = list(modules) if modules is not None else _python_modules_defining(model, function)
    if not targets:
        classes = sorted({type(m).__module__ for m in model.modules()})
        raise MetaRopeError(
            f"no module-level function {function!r} found in the Python modules of the model's classes ({classes}); "
            f"pass modules=[the module that defines it], or function='your_name'"
        )
    for module in targets:
        if not callable(getattr(module, function, None)):
            raise MetaRopeError(f"{module.__name__} has no function {function!r}")
    hook = MetaHook()
    changes: list[tuple[object, str, object]] = []
    for module in targets:
        changes.append((module, function, apply_rotary_emb))
        hook.functions.append(f"{module.__name__}.{function}")
    buffer_changes = []
    for qualified, owner, name, is_buffer in _complex_tensors(model):
        value = owner._buffers[name] if is_buffer else vars(owner)[name]
        if is_buffer:
            buffer_changes.append((owner._buffers, name, torch.view_as_real(value)))
        else:
            changes.append((owner, name, torch.view_as_real(value)))
        hook.tensors.append(qualified)
    with dict_items_patched(buffer_changes), patched(changes):
        yield hook
