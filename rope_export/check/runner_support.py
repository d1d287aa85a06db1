"""What a runner can run of a file, said in one sentence when it cannot: never a silent skip.

onnxruntime's CPU execution provider has bfloat16 kernels for a few ops only (data movement: Cast,
Concat, Gather, Reshape, ...; none for MatMul, Add or Softmax), and its Python API takes no bfloat16
NumPy array. ``onnxruntime_bfloat16_gaps`` reads its kernel registry (``get_all_opkernel_def``) and names
the file's ops it has no bfloat16 kernel for.
"""

from __future__ import annotations

import functools

import onnx

from rope_export.op import contract

BF16 = onnx.TensorProto.BFLOAT16


@functools.cache
def _bfloat16_kernels(provider: str) -> frozenset[tuple[str, str]]:
    """(domain, op type) pairs ``provider`` registers a kernel for with bfloat16 in a type constraint."""
    try:
        from onnxruntime.capi import _pybind_state as ort_c

        defs = ort_c.get_all_opkernel_def()
    except (ImportError, AttributeError):
        return frozenset()
    return frozenset((d.domain or "", d.op_name) for d in defs if d.provider == provider
                     and any("bfloat16" in t for types in d.type_constraints.values() for t in types))


def onnxruntime_bfloat16_gaps(mf, provider: str = "CPUExecutionProvider") -> list[str]:
    """The file's op types with a bfloat16 input or output that ``provider`` has no bfloat16 kernel for."""
    have = _bfloat16_kernels(provider)
    missing = set()
    for node in mf.proto.graph.node:
        typed = [mf.value_type(name) for name in (*node.input, *node.output) if name]
        if any(spec is not None and spec.elem_type == BF16 for spec in typed):
            domain = "" if node.domain in ("ai.onnx", contract.DOMAIN) else node.domain  # ours: lowered to ai.onnx
            if (domain, node.op_type) not in have:
                missing.add(f"{domain}::{node.op_type}" if domain else node.op_type)
    return sorted(missing)


def bfloat16_skip_reason(mf) -> str:
    """Why onnxruntime CPU does not run a bfloat16 file, with the ops it lacks kernels for."""
    import onnxruntime

    gaps = onnxruntime_bfloat16_gaps(mf)
    more = f" and {len(gaps) - 12} more" if len(gaps) > 12 else ""
    parts = [f"its CPU execution provider has no bfloat16 kernel for {', '.join(gaps[:12])}{more} (ops of this "
             "file)"] if gaps else []
    parts.append("its Python API takes no bfloat16 NumPy input")
    return (f"onnxruntime {onnxruntime.__version__}: {'; '.join(parts)}; onnx-reference and cpu-twin run this file "
            "here (onnxruntime-cuda and tensorrt on a GPU)")
