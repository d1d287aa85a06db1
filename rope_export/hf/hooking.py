"""The rotary hook for transformers models, and the guard that keeps the model as it was.

``rotary_hooked(model)`` finds the rotary function(s) the model's code calls with
``rope_export.detect.functions`` (by code and numeric verification, whatever the model_type),
routes them through the rotary op inside the ``with`` block, and restores them on exit, also on
error. ``--hf-family`` (``family=``) narrows detection to that family's form and function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from rope_export.detect.forms import probe
from rope_export.detect.functions import (
    HookedFunctions,
    RotaryFunction,
    called_functions,
    find_rotary_functions,
    recorded_calls,
    rotary_functions_hooked,
)
from rope_export.hf.errors import HFExportError
from rope_export.hf.families import FORMS, HFFamily, family_of, forced_forms


@dataclass
class HookState:
    """What ``rotary_hooked`` swapped, and how often the replacements ran (per eager call or trace)."""

    family: HFFamily
    hooked: HookedFunctions

    @property
    def functions(self) -> list[RotaryFunction]:
        return self.hooked.functions

    @property
    def target(self) -> str:
        return ", ".join(f.qualified for f in self.functions)

    @property
    def probe_error(self) -> float:
        return max(f.error for f in self.functions)

    @property
    def calls(self) -> int:
        return sum(self.hooked.calls.values())

    @property
    def rotations(self) -> int:
        return self.hooked.rotations

    @property
    def interleaved(self) -> bool:
        return any(f.form.node_interleaved for f in self.functions)

    @property
    def description(self) -> str:
        return self.hooked.description


def called_in_forward(model: nn.Module) -> set:
    """The code objects one tiny eager forward of the model runs (``recorded_calls``)."""
    with model_state_kept(model), torch.no_grad(), recorded_calls() as called:
        model(input_ids=torch.zeros(1, 2, dtype=torch.long))
    return called


def detect(model: nn.Module, family: HFFamily, called: set | None = None) -> list[RotaryFunction]:
    """The model's verified rotary functions (only the family's form and function name when it was forced).

    ``called``: the code objects an eager forward ran (``recorded_calls``); by default one tiny
    forward is run to find them, so only functions the model really calls are probed.
    """
    if called is None:
        called = called_in_forward(model)
    found = find_rotary_functions(model, forced_forms(family) if family.forced else None, called=called)
    if family.forced and family.function is not None:
        found = [f for f in found if any(site.name == family.function for site in f.sites)]
    return found


def forced_failure(model: nn.Module, family: HFFamily) -> HFExportError:
    """Why a forced family's form does not fit: the function of that name and how far off it is."""
    form = FORMS[family.form]
    for function, sites in called_functions(model).items():
        if any(site.name == family.function for site in sites):
            where = sites[0].qualified
            if probe(form, function) is None:
                return HFExportError(
                    f"the {form.name} hook does not reproduce {where} on random inputs: this model's rotation is not "
                    f"the {family.form} form; drop --hf-family (detection finds the right form)"
                )
    return HFExportError(f"{type(model).__name__} calls no function named {family.function!r}; drop --hf-family")


def verified_functions(model, fam: HFFamily, called: set, fallback: str) -> list:
    """The rotary functions the model's code called that verify (none with ``fallback`` "plain" or "fuse"); a forced
    family that does not fit, or none verified with ``fallback`` "error", is refused."""
    functions = [] if fallback in ("plain", "fuse") else detect(model, fam, called)
    if not functions and fam.forced and fallback not in ("plain", "fuse"):
        raise forced_failure(model, fam)
    if not functions and fallback == "error":
        raise HFExportError(f"no function {type(model).__name__} calls verifies as a rotary form, and "
                            "fallback='error' was asked; drop it to export plain and fuse")
    return functions


@contextlib.contextmanager
def rotary_hooked(model: nn.Module, *, family: str | HFFamily | None = None,
                  functions: list[RotaryFunction] | None = None) -> Iterator[HookState]:
    """Route the model's rotary function(s) through the rope_export op inside the block only.

    Each function is found in the code the model runs and verified numerically against the op
    contract's forms before it is swapped (or given: ``functions`` from ``detect``); HFExportError
    if none verifies. The originals are restored on exit, also on error.
    """
    if not isinstance(model, nn.Module):
        raise HFExportError("rotary_hooked needs the model (its code is searched), not a config")
    fam = family_of(model, family)
    found = functions if functions is not None else detect(model, fam)
    if not found:
        if fam.forced:
            raise forced_failure(model, fam)
        raise HFExportError(f"no function {type(model).__name__} calls verifies as a rotary form "
                            f"({', '.join(FORMS)})")
    with rotary_functions_hooked(found) as hooked:
        yield HookState(fam, hooked)


@contextlib.contextmanager
def model_state_kept(model: nn.Module) -> Iterator[None]:
    """Undo what tracing may leave on the modules: new or rebound attributes, buffer values and objects.

    transformers' longrope update, for one, stores tensors on its rotary module during forward; an
    export traces with fake tensors, which must not stay behind in the user's model.
    """
    modules = list(model.modules())
    attrs = [dict(vars(m)) for m in modules]
    buffers = [dict(m._buffers) for m in modules]
    values = [{k: v.detach().clone() for k, v in m._buffers.items() if v is not None} for m in modules]
    try:
        yield
    finally:
        for m, saved_attrs, saved_buffers, saved_values in zip(modules, attrs, buffers, values, strict=True):
            current = vars(m)
            for key in [k for k in current if k not in saved_attrs]:
                del current[key]
            for key, value in saved_attrs.items():
                if current.get(key, None) is not value:
                    current[key] = value
            m._buffers.clear()
            m._buffers.update(saved_buffers)
            for key, value in saved_values.items():
                buf = m._buffers[key]
                if not torch.equal(buf, value):
                    with torch.no_grad():
                        buf.copy_(value)
