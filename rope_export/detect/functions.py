"""Find the rotary functions a module's code actually calls, verify them, and hook them.

Discovery reads code, not names: starting from the methods of every class the module is built
from (its own and its submodules'), it collects the global names their code reads (nested code
objects included), resolves them in the defining Python module (``apply_rotary_pos_emb`` in
whatever modeling file the attention lives in, or a function imported from elsewhere, or read as
``some_module.fn``), and keeps the plain Python functions. Each is probed against every form of
``rope_export.detect.forms.FORMS``; one that verifies is a rotary function, one that does not is
searched in turn (a wrapper such as Gemma 4's ``apply_multidimensional_rope`` calls the real one),
to a small depth.

A probe on random inputs calls the function with its default arguments; the block may call it with
others (a ``half=True`` switch, per-head tables, prefix tokens it leaves alone).
``checked_on_real_calls`` therefore runs the block once more with every call of each function also
computed through its replacement, on the block's own arguments: a function whose replacement
differs there (or fails) is not hooked, and says by how much.

``rotary_functions_hooked(module)`` swaps each rotary function, at every place a caller looks it
up, for its form's replacement (one ``torch.ops.rope_export.rotary_embedding`` call per tensor),
counts the calls, and puts the originals back on exit, also on error. The module itself is not
touched.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from torch import nn

from rope_export.detect.forms import FORMS, RotaryForm, difference, probe, replacement_call
from rope_export.exporting.meta import dict_items_patched, patched

SEARCH_DEPTH = 3  # how many calls deep a rotary function may sit below a method
_SKIPPED_PACKAGES = ("torch", "rope_export", "typing", "functools", "builtins", "numpy", "onnx")


@dataclass(frozen=True, eq=False)
class CallSite:
    """A place a caller looks a function up: ``owner.name``.

    ``owner``: a Python module or a class (the attribute is swapped), or the globals dict of code
    compiled outside any module (the entry is swapped).
    """

    owner: object
    name: str

    def __eq__(self, other) -> bool:
        return isinstance(other, CallSite) and self.owner is other.owner and self.name == other.name

    def __hash__(self) -> int:
        return hash((id(self.owner), self.name))

    @property
    def qualified(self) -> str:
        if isinstance(self.owner, dict):
            return f"<{self.owner.get('__name__', 'globals')}>.{self.name}"
        owner = getattr(self.owner, "__name__", type(self.owner).__name__)
        if isinstance(self.owner, type):
            owner = f"{self.owner.__module__}.{owner}"
        return f"{owner}.{self.name}"


@dataclass(frozen=True)
class RotaryFunction:
    """A function verified to compute ``form``, and every place the module's code looks it up."""

    function: Callable
    form: RotaryForm
    fixed_layout: str | None  # its layout when it takes no unsqueeze_dim
    error: float  # worst |original - replacement| on the probe's random inputs
    sites: tuple[CallSite, ...]

    @property
    def qualified(self) -> str:
        return self.sites[0].qualified if self.sites else getattr(self.function, "__qualname__", "?")


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _plain_function(value) -> types.FunctionType | None:
    value = getattr(value, "__wrapped_original__", value)  # one of our own replacements: the original
    if isinstance(value, staticmethod | classmethod):
        value = value.__func__
    if not isinstance(value, types.FunctionType):
        return None
    module = getattr(value, "__module__", None) or ""
    if module.split(".")[0] in _SKIPPED_PACKAGES:
        return None
    return value


def _class_methods_of(cls: type) -> list[types.FunctionType]:
    """The functions defined on ``cls`` and its bases, up to nn.Module (torch's own classes skipped)."""
    methods = []
    for base in cls.__mro__:
        if base in (nn.Module, object) or base.__module__.split(".")[0] == "torch":
            continue
        for value in vars(base).values():
            if isinstance(value, property):
                value = value.fget
            value = value.__func__ if isinstance(value, staticmethod | classmethod) else value
            if isinstance(value, types.FunctionType):
                methods.append(value)
    return methods


def _class_methods(module: nn.Module) -> list[types.FunctionType]:
    """Every function defined on the classes the module is built from (each class once)."""
    classes = dict.fromkeys(type(sub) for sub in module.modules())
    return list(dict.fromkeys(m for cls in classes for m in _class_methods_of(cls)))


def _referenced(function: types.FunctionType) -> Iterator[tuple[CallSite, types.FunctionType]]:
    """(where the caller looks it up, the function) for each plain function the code names."""
    inner = inspect.unwrap(function)
    names = _code_names(inner.__code__)
    namespace = inner.__globals__
    owner = sys.modules.get(namespace.get("__name__", ""))
    if owner is None or vars(owner) is not namespace:
        owner = namespace  # code compiled into a plain dict: swap the dict's entry
    for name in names:
        value = namespace.get(name)
        if isinstance(value, types.ModuleType):  # some_module.fn(...)
            for attribute in names & set(vars(value)):
                target = _plain_function(vars(value)[attribute])
                if target is not None:
                    yield CallSite(value, attribute), target
            continue
        target = _plain_function(value)
        if target is not None:
            yield CallSite(owner, name), target


def _instance_sites(module: nn.Module) -> Iterator[tuple[CallSite, types.FunctionType]]:
    """Functions a submodule holds as attributes and its methods call: ``self.fn(...)``, ``self.ns.fn(...)``."""
    for sub in module.modules():
        names = set()
        for method in _class_methods_of(type(sub)):
            names |= _code_names(inspect.unwrap(method).__code__)
        for name, value in vars(sub).items():
            if name not in names:
                continue
            target = _plain_function(value)
            if target is not None:
                yield CallSite(sub, name), target
            elif isinstance(value, types.SimpleNamespace | types.ModuleType):
                for attribute in names & set(vars(value)):
                    target = _plain_function(vars(value)[attribute])
                    if target is not None:
                        yield CallSite(value, attribute), target


def _walk(module: nn.Module, depth: int, stop: Callable[[types.FunctionType], bool]
          ) -> dict[types.FunctionType, set[CallSite]]:
    """Every plain function the module's methods call, up to ``depth`` calls deep, with its call sites.

    ``stop(function)`` is asked once per function; True means "do not search what it calls".
    """
    sites: dict[types.FunctionType, set[CallSite]] = {}
    frontier = _class_methods(module)
    found = list(_instance_sites(module))
    for _ in range(depth):
        found += [pair for caller in frontier for pair in _referenced(caller)]
        frontier = []
        for site, target in found:
            new = target not in sites
            sites.setdefault(target, set()).add(site)
            if new and not stop(target):
                frontier.append(target)
        found = []
    return sites


def called_functions(module: nn.Module, depth: int = SEARCH_DEPTH) -> dict[types.FunctionType, tuple[CallSite, ...]]:
    """Every plain Python function the module's code calls (``depth`` calls deep), with where it is looked up."""
    return {f: _ordered(s) for f, s in _walk(module, depth, lambda f: False).items()}


def _ordered(sites: set[CallSite]) -> tuple[CallSite, ...]:
    return tuple(sorted(sites, key=lambda s: s.qualified))


def verify(function: Callable, forms: Iterable[RotaryForm] | None = None):
    """The first form ``function`` verifies against (a ``ProbeResult``), or None."""
    for form in forms if forms is not None else FORMS.values():
        result = probe(form, function)
        if result is not None:
            return result
    return None


@contextlib.contextmanager
def recorded_calls() -> Iterator[set[types.CodeType]]:
    """The code objects of every Python function called inside the block (this thread).

    Wrap one eager forward in it and hand the set to ``find_rotary_functions(called=...)``: only
    functions the forward really ran are probed (and a function never run cannot be the rotation).
    """
    called: set[types.CodeType] = set()
    previous = sys.getprofile()

    def record(frame, event, arg):
        if event == "call":
            called.add(frame.f_code)

    sys.setprofile(record)
    try:
        yield called
    finally:
        sys.setprofile(previous)


def find_rotary_functions(module: nn.Module, forms: Iterable[RotaryForm] | None = None, *,
                          depth: int = SEARCH_DEPTH, called: set[types.CodeType] | None = None
                          ) -> list[RotaryFunction]:
    """The rotary functions ``module``'s code calls, each verified numerically against a form.

    A function that verifies is not searched further (what it calls is its own business); one that
    does not is, so a wrapper around the real rotation leads to it. With ``called`` (from
    ``recorded_calls`` around one eager forward) only functions that forward ran are probed;
    without it every function the code names is (probing calls it on small random tensors).
    """
    forms = list(forms) if forms is not None else list(FORMS.values())
    verdicts = {}

    def stop(function) -> bool:
        if called is not None and inspect.unwrap(function).__code__ not in called:
            verdicts[function] = None
            return True  # never ran: neither it nor what only it calls is the rotation
        verdicts[function] = verify(function, forms)
        return verdicts[function] is not None

    sites = _walk(module, depth, stop)
    found = [RotaryFunction(function, result.form, result.fixed_layout, result.error, _ordered(sites[function]))
             for function, result in verdicts.items() if result is not None]
    return sorted(found, key=lambda f: f.qualified)


@dataclass
class HookedFunctions:
    """What ``rotary_functions_hooked`` swapped, and how many tensors went through the op since."""

    functions: list[RotaryFunction]
    calls: dict[str, int] = field(default_factory=dict)  # qualified name -> calls
    tensors: dict[str, int] = field(default_factory=dict)  # qualified name -> tensors rotated

    @property
    def rotations(self) -> int:
        return sum(self.tensors.values())

    def reset(self) -> None:
        self.calls.clear()
        self.tensors.clear()

    @property
    def description(self) -> str:
        return "; ".join(f"{f.qualified} -> rope_export::RotaryEmbedding ({f.form.name}, "
                         f"{f.form.tensors_per_call} per call)" for f in self.functions)


def _replacement(rotary: RotaryFunction, state: HookedFunctions) -> Callable:
    signature = inspect.signature(rotary.function)
    arity = rotary.form.convention.arity
    name = rotary.qualified

    def replacement(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        positional = list(bound.args)[:arity]
        state.calls[name] = state.calls.get(name, 0) + 1
        rotated = sum(positional[i] is not None for i in rotary.form.convention.tensors)
        state.tensors[name] = state.tensors.get(name, 0) + rotated
        return replacement_call(rotary.form, positional, dict(bound.arguments), rotary.fixed_layout)

    replacement.__name__ = getattr(rotary.function, "__name__", "replacement")
    replacement.__doc__ = f"rope_export replacement of {name} (active inside rotary_functions_hooked only)"
    replacement.__wrapped_original__ = rotary.function
    return replacement


@dataclass
class RealCallCheck:
    """One rotary function on the block's own calls: the worst |original - replacement|, or why it failed."""

    function: RotaryFunction
    calls: int = 0
    error: float = 0.0
    failure: str = ""  # the replacement raised, or returned other shapes

    @property
    def ok(self) -> bool:
        from rope_export.op.tolerances import tolerance

        return self.calls > 0 and not self.failure and tolerance("op", "float32").allclose(self.error, 0.0)

    @property
    def why(self) -> str:
        """Why the function is not hooked (empty when it is)."""
        name = self.function.qualified
        if self.failure:
            return f"{name}: its replacement ({self.function.form.name}) fails on the block's own call: {self.failure}"
        if self.calls == 0:
            return f"{name}: not called by the block's forward"
        return (f"{name}: on the block's own call its replacement ({self.function.form.name}) differs from it by "
                f"{self.error:.2e}")


def checked_on_real_calls(module: nn.Module, args: tuple, kwargs: dict,
                          functions: Iterable[RotaryFunction]) -> list[RealCallCheck]:
    """Run ``module(*args, **kwargs)`` once; each call of each function is answered by the original and
    compared with its replacement on the same arguments (the block computes what it always does)."""
    import torch

    checks = [RealCallCheck(f) for f in functions]
    attributes, entries = [], []
    for check in checks:
        original, replacement = check.function.function, _replacement(check.function, HookedFunctions([]))

        def checking(*a, _check=check, _original=original, _replacement=replacement, **kw):
            want = _original(*a, **kw)
            _check.calls += 1
            try:
                got = _replacement(*a, **kw)
            except Exception as exc:  # noqa: BLE001 - any refusal of the block's own shapes
                _check.failure = _check.failure or f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                return want
            error = difference(got, want)
            if error == float("inf"):
                _check.failure = _check.failure or "it returns other shapes than the function"
            _check.error = max(_check.error, error)
            return want

        for site in check.function.sites:
            change = (site.owner, site.name, checking)
            (entries if isinstance(site.owner, dict) else attributes).append(change)
    with dict_items_patched(entries), patched(attributes), torch.no_grad():
        module(*args, **kwargs)
    return checks


@contextlib.contextmanager
def rotary_functions_hooked(module_or_functions: nn.Module | Iterable[RotaryFunction], *,
                            forms: Iterable[RotaryForm] | None = None) -> Iterator[HookedFunctions]:
    """Inside the block, every rotary function the module calls goes through the rotary op.

    Give a module (its functions are found and verified first) or the ``RotaryFunction``s that
    ``find_rotary_functions`` returned. The originals are back on exit, also when the body raises.
    """
    if isinstance(module_or_functions, nn.Module):
        functions = find_rotary_functions(module_or_functions, forms)
    else:
        functions = list(module_or_functions)
    state = HookedFunctions(functions)
    attributes, entries = [], []
    for rotary in functions:
        for site in rotary.sites:
            change = (site.owner, site.name, _replacement(rotary, state))
            (entries if isinstance(site.owner, dict) else attributes).append(change)
    with dict_items_patched(entries), patched(attributes):
        yield state
