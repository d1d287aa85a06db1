"""Before ``export_module`` writes anything: the fused file, lowered to the standard op (``lower
--target onnx``), runs once on onnxruntime against the eager block, on the block's own example
inputs and, where the block takes integer inputs (positions), with those shifted past the traced
length. An output outside the block tolerance (``rope_export.op.tolerances``) raises
``FileMismatchError`` naming the output, the case, the error size and the file's rotary nodes;
nothing is written then.

This is the end-to-end backstop behind the per-site checks: each fused site is verified against
the op contract by the fusion (``passes._verify``), and each hooked function on the block's own
calls (``detect.functions.checked_on_real_calls``); a runtime that refuses a node (caches of the
wrong shape) fails here too, as onnxruntime would in deployment.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch
from torch.utils._pytree import tree_leaves, tree_map

from rope_export.files import onnx_files
from rope_export.op.tolerances import tolerance

MAX_WEIGHTS = onnx_files.EXTERNAL_DATA_THRESHOLD  # above this the file is not run here (a copy of the weights)


class FileMismatchError(ValueError):
    """The fused file computes something other than the eager block; the message names where and by how much."""


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _shifted(args: tuple, kwargs: dict) -> tuple[tuple, dict, int] | None:
    """(args, kwargs, offset) with every integer tensor input shifted past its largest value, or None."""
    ints = [t for t in _tensors((args, kwargs)) if not t.is_floating_point() and t.dtype != torch.bool]
    if not ints or any(t.numel() == 0 for t in ints):
        return None
    offset = int(max(int(t.max()) for t in ints)) + 1

    def shift(value):
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool:
            return value + offset
        return value

    return tree_map(shift, args), tree_map(shift, kwargs), offset


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


def check_on_onnxruntime(module: torch.nn.Module, args: tuple, kwargs: dict, model: ir.Model) -> list[str]:
    """Run ``model`` lowered to ``onnx`` on onnxruntime against ``module``; returns notes (what was not run).

    Raises FileMismatchError when an output differs beyond the block tolerance."""
    import onnxruntime as ort

    from rope_export.detect import rotary_nodes
    from rope_export.passes import lower

    if onnx_files.weight_bytes(model) > MAX_WEIGHTS:
        return ["the file was not run on onnxruntime before writing (weights past 2 GB): run rope-export check "
                "on it"]
    inputs = _tensors((args, kwargs))
    names = [v.name for v in model.graph.inputs]
    if len(inputs) != len(names):
        return [f"the file was not run on onnxruntime before writing: its {len(names)} inputs are not the "
                f"example's {len(inputs)} tensors"]
    if any(t.dtype == torch.bfloat16 for t in inputs) or any(
            v.dtype == ir.DataType.BFLOAT16 for v in model.graph.outputs):
        return ["the file was not run on onnxruntime before writing: onnxruntime's CPU provider has no bfloat16 "
                "kernels"]
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a failure is raised with its message; onnxruntime need not log it too
    sites = ", ".join(n.name for n in rotary_nodes(model)) or "none"
    proto = lower(ir.to_proto(model), "onnx")
    try:
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - a file onnxruntime cannot load is not written
        raise FileMismatchError(f"onnxruntime refuses the fused file (lowered to onnx): {_first_line(exc)}; "
                                f"rotary nodes: {sites}; nothing was written") from None
    del proto
    cases = [("the example", args, kwargs)]
    notes = []
    shifted = _shifted(args, kwargs)
    if shifted is not None:
        cases.append((f"the example's integer inputs (positions) + {shifted[2]}", shifted[0], shifted[1]))
    for label, a, kw in cases:
        try:
            with torch.no_grad():
                want = _tensors(module(*a, **kw))
        except Exception as exc:  # noqa: BLE001 - the block itself refuses these positions: nothing to compare
            notes.append(f"not compared on {label}: the eager block refuses it ({type(exc).__name__})")
            continue
        feeds = {n: t.detach().cpu().numpy() for n, t in zip(names, _tensors((a, kw)), strict=True)}
        try:
            got = session.run(None, feeds)
        except Exception as exc:  # noqa: BLE001 - e.g. caches that do not fit the rotated tensor
            raise FileMismatchError(f"onnxruntime fails on the fused file (lowered to onnx) on {label}: "
                                    f"{_first_line(exc)}; rotary nodes: {sites}; nothing was written") from None
        if len(got) != len(want):
            notes.append(f"not compared on {label}: {len(got)} file outputs, {len(want)} eager outputs")
            continue
        for value, g, w in zip(model.graph.outputs, got, want, strict=True):
            w = w.detach().cpu().numpy()
            tol = tolerance("block", str(w.dtype) if w.dtype != np.float64 else "float32").at_scale_of(w)
            if g.shape != w.shape:
                raise FileMismatchError(f"output {value.name!r} has shape {list(g.shape)} in the file, "
                                        f"{list(w.shape)} in the eager block, on {label}; rotary nodes: {sites}; "
                                        "nothing was written")
            if not tol.allclose(g, w):
                error = float(np.nanmax(np.abs(g.astype(np.float64) - w.astype(np.float64))))
                raise FileMismatchError(
                    f"the fused file differs from the eager block on {label}: output {value.name!r} by {error:.2e} "
                    f"(tolerance {tol.atol:.0e}); rotary nodes: {sites}; nothing was written")
    return notes
