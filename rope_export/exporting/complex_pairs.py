"""Complex tensors held as their real pairs ``[..., 2]`` while a module is traced for export.

torch.onnx cannot export complex tensors: a complex ``freqs_cis`` buffer indexed by positions
(``freqs_cis[pos]``, torchtitan's ``gather``), sliced, unsqueezed or reshaped for broadcast fails in
its converter ("No decompositions registered for the complex-valued input"), whatever library wrote it.
Rather than a rule per spelling, ``complex_as_pairs(module)`` runs the module's forward under a
``TorchFunctionMode`` that represents every complex tensor as a ``Pairs`` object holding
``torch.view_as_real`` of it, and answers every torch function on it with the same computation on the
real view:

* creation: ``view_as_complex(x)`` is ``x`` itself; ``polar(m, a)`` is ``stack(m cos a, m sin a)``;
  ``complex(re, im)``, ``exp(1j * a)`` likewise; a complex buffer or constant is taken as its real view;
* moving elements (indexing, ``gather``, ``view``/``reshape``, ``unsqueeze``, ``expand``, ``permute``,
  ``cat``, ...): the same op on the real view, with dims shifted past the pair axis;
* arithmetic: a complex product ``a * b`` is written as gpt-fast writes its real 5-D view,
  ``stack((a0 b0 - a1 b1, a1 b0 + a0 b1), -1)``; ``conj`` negates the imaginary part;
* ``view_as_real`` returns the pairs; ``.real``/``.imag``/``.shape``/``.dtype`` answer as for the complex
  tensor.

The traced graph then holds only real ops, and a complex rotation in it is the pair-by-pair rotation
the graph fusion (``rope_export.passes.fuse``) finds and verifies like any other. The mode is active only
inside the module's forward (the exporter's own bookkeeping of complex buffers is untouched), and an op
on a complex tensor it has no rewrite for raises ``ComplexRewriteError`` naming the op.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

_REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}
_COMPLEX = {v: k for k, v in _REAL.items()}


class ComplexRewriteError(RuntimeError):
    """A complex op met while tracing that has no real-pair rewrite; the message names it."""


class Pairs:
    """A complex tensor of shape ``S`` held as its real view ``pairs`` of shape ``S + [2]``."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: torch.Tensor):
        if not isinstance(pairs, torch.Tensor) or pairs.is_complex() or pairs.dim() == 0 or pairs.shape[-1] != 2:
            raise ComplexRewriteError(f"a complex tensor's real view must end in a pair axis of 2, got "
                                      f"{getattr(pairs, 'shape', type(pairs).__name__)}")
        self.pairs = pairs

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _apply(func, args, kwargs or {})

    # Python operators and attributes reach the handlers directly (not through the mode)
    def __getattr__(self, name):
        if name in _GETTERS:
            return _GETTERS[name](self)
        if name in _HANDLERS:
            return functools.partial(_HANDLERS[name], self)
        raise ComplexRewriteError(f"complex tensor method {name!r} has no real-pair rewrite "
                                  "(rope_export.exporting.complex_pairs)")

    def __getitem__(self, index):
        return _getitem(self, index)

    def __setitem__(self, index, value):
        _setitem(self, index, value)

    def __mul__(self, other):
        return _mul(self, other)

    __rmul__ = __mul__

    def __add__(self, other):
        return _add(self, other)

    __radd__ = __add__

    def __sub__(self, other):
        return _add(self, _neg(other) if isinstance(other, Pairs) else -other)

    def __rsub__(self, other):
        return _add(_neg(self), other)

    def __neg__(self):
        return _neg(self)

    def __truediv__(self, other):
        return _div(self, other)

    def __len__(self):
        return self.pairs.shape[0]

    def __repr__(self):
        return f"Pairs(complex {list(self.pairs.shape[:-1])} as real {list(self.pairs.shape)})"


# -- helpers -------------------------------------------------------------------------------------

def _as_pairs(value):
    if isinstance(value, Pairs):
        return value
    if isinstance(value, torch.Tensor) and value.is_complex():
        return Pairs(torch.view_as_real(value.resolve_conj()))
    if isinstance(value, complex):
        return value
    return value


def _n(p: Pairs) -> int:
    return p.pairs.dim() - 1


def _dim(d: int, n: int) -> int:
    """A dim of the complex tensor (rank n) as a dim of its real view (the pair axis stays last)."""
    return d % n if n else 0


def _sizes(args) -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


def _parts(p: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
    return p.pairs[..., 0], p.pairs[..., 1]


def _make(re: torch.Tensor, im: torch.Tensor) -> Pairs:
    return Pairs(torch.stack((re, im), dim=-1))


def _mul(a, b):
    if isinstance(b, Pairs) and not isinstance(a, Pairs):
        a, b = b, a
    if isinstance(b, Pairs):
        if b.pairs.numel() > a.pairs.numel():  # the rotated tensor first, the table second (gpt-fast's order)
            a, b = b, a
        a0, a1 = _parts(a)
        b0, b1 = _parts(b)
        return _make(a0 * b0 - a1 * b1, a1 * b0 + a0 * b1)
    if isinstance(b, complex):
        a0, a1 = _parts(a)
        return _make(a0 * b.real - a1 * b.imag, a1 * b.real + a0 * b.imag)
    if isinstance(b, torch.Tensor):
        return Pairs(a.pairs * b.unsqueeze(-1))
    return Pairs(a.pairs * b)


def _div(a, b):
    if not isinstance(a, Pairs) or isinstance(b, (Pairs, complex)):
        raise ComplexRewriteError("division by a complex value has no real-pair rewrite")
    return Pairs(a.pairs / (b.unsqueeze(-1) if isinstance(b, torch.Tensor) else b))


def _add(a, b):
    if not isinstance(a, Pairs):
        a, b = b, a
    if isinstance(b, Pairs):
        return Pairs(a.pairs + b.pairs)
    if isinstance(b, complex):
        a0, a1 = _parts(a)
        return _make(a0 + b.real, a1 + b.imag)
    a0, a1 = _parts(a)
    return _make(a0 + b, a1)


def _neg(p: Pairs) -> Pairs:
    return Pairs(-p.pairs)


def _conj(p: Pairs) -> Pairs:
    re, im = _parts(p)
    return _make(re, -im)


def _getitem(p: Pairs, index):
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):
        index = (*index, slice(None))
    return Pairs(p.pairs[index])


def _setitem(p: Pairs, index, value) -> None:
    """``p[index] = value`` on the pairs (a complex value, or a real one as its real part)."""
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):
        index = (*index, slice(None))
    if isinstance(value, complex):
        value = Pairs(torch.tensor([value.real, value.imag], dtype=p.pairs.dtype))
    if not isinstance(value, Pairs):
        raise ComplexRewriteError("writing real values into a complex tensor has no real-pair rewrite")
    p.pairs[index] = value.pairs


def _to(p: Pairs, *args, **kwargs):
    if any(isinstance(a, torch.dtype) and not a.is_complex for a in (*args, kwargs.get("dtype"))):
        raise ComplexRewriteError("casting a complex tensor to a real dtype has no real-pair rewrite")
    args = tuple(_REAL.get(a, a) if isinstance(a, torch.dtype) else a for a in args)
    if "dtype" in kwargs:
        kwargs["dtype"] = _REAL.get(kwargs["dtype"], kwargs["dtype"])
    return Pairs(p.pairs.to(*args, **kwargs))


def _where(condition, a, b):
    """``where(condition, a, b)`` of complex values (a real number is its real part), per pair."""
    like = next(v.pairs for v in (a, b) if isinstance(v, Pairs))

    def side(v):
        if isinstance(v, Pairs):
            return v.pairs
        if isinstance(v, (int, float)):
            return torch.stack((torch.full_like(like[..., 0], v), torch.zeros_like(like[..., 0])), dim=-1)
        raise ComplexRewriteError(f"where of a complex tensor and a {type(v).__name__} has no real-pair rewrite")

    return Pairs(torch.where(condition.unsqueeze(-1), side(a), side(b)))


def _squeeze(p: Pairs, dim=None):
    n = _n(p)
    if dim is None:
        dims = tuple(i for i in range(n) if p.pairs.shape[i] == 1)
    else:
        dims = tuple(_dim(d, n) for d in (dim if isinstance(dim, (tuple, list)) else (dim,)))
    return Pairs(p.pairs.squeeze(dims) if dims else p.pairs)


def _unsqueeze(p: Pairs, dim: int):
    return Pairs(p.pairs.unsqueeze(dim % (_n(p) + 1)))


def _flatten(p: Pairs, start_dim: int = 0, end_dim: int = -1):
    n = _n(p)
    return Pairs(p.pairs.flatten(_dim(start_dim, n), _dim(end_dim, n)))


def _permute(p: Pairs, *dims):
    n = _n(p)
    return Pairs(p.pairs.permute(*(_dim(d, n) for d in _sizes(dims)), n))


def _transpose(p: Pairs, a: int, b: int):
    n = _n(p)
    return Pairs(p.pairs.transpose(_dim(a, n), _dim(b, n)))


def _gather(p: Pairs, dim: int, index: torch.Tensor, **kwargs):
    index = index.unsqueeze(-1).expand(*index.shape, 2)
    return Pairs(torch.gather(p.pairs, _dim(dim, _n(p)), index, **kwargs))


def _join(stack: bool, tensors, dim: int = 0):
    items = [_as_pairs(t) for t in tensors]
    if not all(isinstance(t, Pairs) for t in items):
        raise ComplexRewriteError("joining complex with real tensors has no real-pair rewrite")
    n = _n(items[0]) + (1 if stack else 0)
    join = torch.stack if stack else torch.cat
    return Pairs(join([t.pairs for t in items], dim=_dim(dim, n)))


def _exp(p: Pairs):
    re, im = _parts(p)
    magnitude = torch.exp(re)
    return _make(magnitude * torch.cos(im), magnitude * torch.sin(im))


def _size(p: Pairs, dim=None):
    shape = p.pairs.shape[:-1]
    return torch.Size(shape) if dim is None else shape[dim]


def _type_as(p: Pairs, other):
    if isinstance(other, Pairs) or (isinstance(other, torch.Tensor) and other.is_complex()):
        return p
    raise ComplexRewriteError("casting a complex tensor to a real dtype (type_as) has no real-pair rewrite")


_GETTERS = {
    "shape": lambda p: torch.Size(p.pairs.shape[:-1]),
    "ndim": _n,
    "real": lambda p: p.pairs[..., 0],
    "imag": lambda p: p.pairs[..., 1],
    "dtype": lambda p: _COMPLEX.get(p.pairs.dtype, torch.complex64),
    "device": lambda p: p.pairs.device,
    "is_cuda": lambda p: p.pairs.is_cuda,
    "T": lambda p: _permute(p, *reversed(range(_n(p)))),
}

_HANDLERS = {
    "view_as_real": lambda p: p.pairs,
    "view": lambda p, *shape: Pairs(p.pairs.view(*_sizes(shape), 2)),
    "reshape": lambda p, *shape: Pairs(p.pairs.reshape(*_sizes(shape), 2)),
    "expand": lambda p, *sizes, **kw: Pairs(p.pairs.expand(*_sizes(sizes), 2)),
    "expand_as": lambda p, other: Pairs(p.pairs.expand(*other.shape, 2)),
    "repeat": lambda p, *sizes: Pairs(p.pairs.repeat(*_sizes(sizes), 1)),
    "unsqueeze": _unsqueeze,
    "squeeze": _squeeze,
    "flatten": _flatten,
    "permute": _permute,
    "transpose": _transpose,
    "gather": _gather,
    "where": _where,
    "index_select": lambda p, dim, index: Pairs(p.pairs.index_select(_dim(dim, _n(p)), index)),
    "narrow": lambda p, dim, start, length: Pairs(p.pairs.narrow(_dim(dim, _n(p)), start, length)),
    "__getitem__": _getitem,
    "__setitem__": _setitem,
    "zeros_like": lambda p, **k: Pairs(torch.zeros_like(p.pairs, dtype=_REAL.get(k.get("dtype"), p.pairs.dtype))),
    "contiguous": lambda p, *a, **k: Pairs(p.pairs.contiguous()),
    "clone": lambda p, *a, **k: Pairs(p.pairs.clone()),
    "detach": lambda p: Pairs(p.pairs.detach()),
    "to": _to,
    "type_as": _type_as,
    "conj": _conj,
    "conj_physical": _conj,
    "resolve_conj": lambda p: p,
    "resolve_neg": lambda p: p,
    "mul": _mul,
    "multiply": _mul,
    "__mul__": _mul,
    "__rmul__": _mul,
    "add": _add,
    "__add__": _add,
    "__radd__": _add,
    "sub": lambda a, b: Pairs.__sub__(a, b) if isinstance(a, Pairs) else Pairs.__rsub__(b, a),
    "__sub__": lambda a, b: Pairs.__sub__(a, b) if isinstance(a, Pairs) else Pairs.__rsub__(b, a),
    "neg": _neg,
    "__neg__": _neg,
    "div": _div,
    "__truediv__": _div,
    "exp": _exp,
    "abs": lambda p: torch.linalg.vector_norm(p.pairs, dim=-1),
    "angle": lambda p: torch.atan2(p.pairs[..., 1], p.pairs[..., 0]),
    "size": _size,
    "dim": _n,
    "numel": lambda p: p.pairs.numel() // 2,
    "is_complex": lambda p: True,
    "is_floating_point": lambda p: False,
    "is_contiguous": lambda p, *a, **k: p.pairs.is_contiguous(),
    "cat": lambda tensors, dim=0, **k: _join(False, tensors, dim),
    "concat": lambda tensors, dim=0, **k: _join(False, tensors, dim),
    "stack": lambda tensors, dim=0, **k: _join(True, tensors, dim),
}


def _name(func) -> str:
    owner = getattr(func, "__self__", None)
    if type(func).__name__ == "method-wrapper" and hasattr(owner, "__name__"):
        return "get:" + owner.__name__  # a Tensor property's getter: Tensor.shape.__get__
    return getattr(func, "__name__", "")


def _creators(name: str, args, kwargs):
    """A complex tensor made from real ones, as its pairs (None: not a creator)."""
    if name == "view_as_complex":
        return Pairs(args[0])
    if name == "polar":
        magnitude, angle = (list(args) + [kwargs.get("abs"), kwargs.get("angle")])[:2]
        return _make(magnitude * torch.cos(angle), magnitude * torch.sin(angle))
    if name == "complex":
        return _make(*args[:2])
    if name in ("zeros", "empty") and kwargs.get("dtype") in _REAL:  # a complex buffer to be written
        size = _sizes(args)
        options = {k: v for k, v in kwargs.items() if k in ("device", "layout", "pin_memory")}
        return Pairs(torch.zeros(*size, 2, dtype=_REAL[kwargs["dtype"]], **options))
    if name in ("mul", "__mul__", "__rmul__", "multiply") and any(isinstance(a, complex) for a in args[:2]):
        scalar = next(a for a in args[:2] if isinstance(a, complex))
        other = next(a for a in args[:2] if a is not scalar)
        return _make(other * scalar.real, other * scalar.imag)
    return None


def _apply(func, args, kwargs):
    name = _name(func)
    flat, _ = tree_flatten((args, kwargs))
    complex_in = any(isinstance(t, Pairs) or (isinstance(t, torch.Tensor) and t.is_complex()) for t in flat)
    if not complex_in:
        made = _creators(name, args, kwargs)
        return made if made is not None else func(*args, **kwargs)
    args, kwargs = tree_map(_as_pairs, (args, kwargs))
    if name.startswith("get:"):
        getter = _GETTERS.get(name[4:])
        if getter is None:
            raise ComplexRewriteError(f"complex tensor attribute {name[4:]!r} has no real-pair rewrite "
                                      "(rope_export.exporting.complex_pairs)")
        return getter(args[0])
    if name == "view_as_complex":
        raise ComplexRewriteError("view_as_complex of a complex tensor")
    handler = _HANDLERS.get(name)
    if handler is None:
        raise ComplexRewriteError(f"torch op {name!r} on a complex tensor has no real-pair rewrite "
                                  "(rope_export.exporting.complex_pairs)")
    return handler(*args, **kwargs)


class _PairsMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return _apply(func, args, kwargs or {})


def _unwrap_outputs(value):
    """Outputs of the forward: a complex one stays complex (its pairs viewed back)."""
    return tree_map(lambda v: torch.view_as_complex(v.pairs) if isinstance(v, Pairs) else v, value)


@contextlib.contextmanager
def complex_as_pairs(module: nn.Module) -> Iterator[None]:
    """Inside, ``module``'s forward runs with every complex tensor held as real pairs (see the module doc)."""
    from rope_export.exporting.meta import patched

    forward = module.forward

    @functools.wraps(forward)
    def paired_forward(*args, **kwargs):
        with _PairsMode():
            out = forward(*args, **kwargs)
        return _unwrap_outputs(out)

    with patched([(module, "forward", paired_forward)]):
        yield


def has_complex(module: nn.Module) -> bool:
    """Whether the module holds a complex tensor (buffer, parameter or plain attribute)."""
    tensors = list(module.buffers()) + list(module.parameters())
    tensors += [v for m in module.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    return any(t.is_complex() for t in tensors)


__all__ = ["ComplexRewriteError", "Pairs", "complex_as_pairs", "has_complex"]
