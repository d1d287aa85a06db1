"""The zoo's harness: export one tiny model type with default flags and compare it with transformers.

``check_type(model_type)`` builds the type's tiny config (``zoo_configs``), runs ``export_hf`` with
default flags, and compares the file with transformers itself: logits and every present key/value
for a prefill (past 0) and one decode step, the file run on onnxruntime after the ``onnx``
lowering (onnx.reference where onnxruntime has no kernel). The rotary node count is compared
with the rotations transformers performs in one eager forward (``export_hf`` already refuses a
shortfall; the harness checks equality again on its own).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from hf_zoo_configs import VOCAB, tiny_config

from rope_export import hf
from rope_export.detect import count_rotations
from rope_export.exporting.core import count_rotary_nodes
from rope_export.op.tolerances import tolerance

TOL = tolerance("block", "float32")
PREFILL, BATCH = 6, 2


@dataclass
class ZooResult:
    model_type: str
    status: str  # "pass", "refused" (a clear HFExportError), "fail" (anything else)
    reason: str = ""
    rotations: int = 0  # transformers' rotations in one eager forward (prefill)
    rotary_nodes: int = 0
    how: str = ""  # "hook: <form>" or "fuse"
    max_error: float = 0.0
    seconds: float = 0.0
    checks: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "checks"}


def zoo_param(model_type: str, fast, results: dict):
    """The type as a pytest param: ``slow`` unless in ``fast``, an expected failure (strict) where ``results``
    records one, so a fix shows up as an XPASS to record."""
    import pytest

    marks = [] if model_type in fast else [pytest.mark.slow]
    recorded = results.get(model_type)
    if recorded is not None and recorded["status"] == "fail":
        marks.append(pytest.mark.xfail(strict=True, reason=recorded["reason"]))
    return pytest.param(model_type, marks=marks, id=model_type)


def record(result, variable: str) -> None:
    """Append the result to the JSON-lines file the environment ``variable`` names (``make hf-zoo`` sets it)."""
    import json
    import os

    path = os.environ.get(variable)
    if path:
        with open(path, "a") as sink:
            sink.write(json.dumps(result.as_dict()) + "\n")


def runner(model: onnx.ModelProto):
    """onnxruntime on the ``onnx`` lowering; onnx.reference with our OpRun when onnxruntime refuses the file."""
    import onnxruntime as ort

    from rope_export.passes import lower

    try:
        session = ort.InferenceSession(lower(model, "onnx").SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - an op onnxruntime lacks: fall back to the reference evaluator
        from onnx.reference import ReferenceEvaluator

        from rope_export.op.onnx_op import RotaryEmbedding

        evaluator = ReferenceEvaluator(model, new_ops=[RotaryEmbedding])
        names = [i.name for i in model.graph.input]
        return lambda inputs: evaluator.run(None, dict(zip(names, inputs, strict=True)))
    names = [i.name for i in session.get_inputs()]
    return lambda inputs: session.run(None, dict(zip(names, inputs, strict=True)))


def positions(rank: int, start: int, length: int) -> torch.Tensor:
    p = torch.arange(start, start + length).expand(BATCH, length)
    if rank == 3:
        p = torch.stack((p, p // 2, p % 3 + p // 3))
    return p.contiguous()


def _compare(got, want: torch.Tensor, what: str, tail: bool = False) -> float:
    got, want = np.asarray(got, np.float32), want.float().numpy()
    if tail:  # a sliding-window layer: transformers keeps the last tokens only; the file keeps all
        got = got[:, :, -want.shape[2]:, :]
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    error = float(np.abs(got - want).max()) if got.size else 0.0
    assert TOL.allclose(got, want), f"{what}: max error {error:.3g}"
    return error


def compare_with_transformers(model, result: hf.HFExportResult, steps: int = 1) -> float:
    """Prefill then ``steps`` decode steps: logits and present keys/values of the file against transformers."""
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

    run = runner(result.model)
    rank = result.family.position_rank
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, PREFILL), generator=generator)
    cache = DynamicCache(config=model.config)  # transformers' own cache, sliding layers cropped as usual
    past = [np.zeros(shape, np.float32) for io in result.layout.layers for shape in io.shapes(BATCH, 0)]
    start, worst = 0, 0.0
    for step in range(steps + 1):
        pos = positions(rank, start, ids.shape[1])
        with torch.no_grad():
            want = hf.with_cache(model, cache, input_ids=ids, position_ids=pos).logits
        out = run([ids.numpy(), pos.numpy(), *past])
        worst = max(worst, _compare(out[0], want, f"step {step} logits"))
        past = out[1:]
        want_present = result.layout.present(cache)
        for n, name in enumerate(result.layout.output_names()):
            sliding = isinstance(cache.layers[int(name.split(".")[1])], DynamicSlidingWindowLayer)
            worst = max(worst, _compare(past[n], want_present[n], f"step {step} {name}", sliding))
        start += ids.shape[1]
        ids = want[:, -1:].argmax(-1)
    return worst


def build(model_type: str):
    """The type's tiny model; parameters transformers initialises to zero (routers, gates) get small random
    values, so that no top-k choice is a tie the file and transformers may break differently."""
    model = hf.build_hf_model(tiny_config(model_type), seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.numel() > 1 and parameter.is_floating_point() and not parameter.any():
                parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator))
    return model


def check_type(model_type: str) -> ZooResult:
    """Export with default flags and compare with transformers; the result says what happened."""
    start = time.perf_counter()
    result = ZooResult(model_type, "fail")
    try:
        model = build(model_type)
    except Exception as exc:  # noqa: BLE001 - the zoo records every outcome
        result.reason = f"the tiny config does not build: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return result
    try:
        exported = hf.export_hf(model)
    except hf.HFExportError as exc:
        result.status, result.reason = "refused", str(exc).splitlines()[0]
        result.seconds = time.perf_counter() - start
        return result
    except Exception as exc:  # noqa: BLE001
        result.reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
        result.seconds = time.perf_counter() - start
        return result
    result.rotary_nodes = count_rotary_nodes(exported.model)
    result.rotations = exported.rotations
    result.how = ("fuse" if exported.hook.startswith("none") else
                  "hook: " + ", ".join(sorted({part.split("(")[1].split(",")[0]
                                                for part in exported.hook.split("; ")})))
    try:
        # the count on its own: transformers' eager rotations of a plain prefill, unhooked
        census = count_rotations(hf.CausalLMWithCache(model, exported.layout),
                                 hf.hf_example_inputs(model, layout=exported.layout,
                                                      position_rank=exported.family.position_rank))
        assert len(census.plain) == result.rotary_nodes, \
            f"{len(census.plain)} eager rotations but {result.rotary_nodes} rotary nodes"
        assert result.rotary_nodes > 0, "no rotary node"
        result.max_error = compare_with_transformers(model, exported)
        result.status = "pass"
    except AssertionError as exc:
        result.reason = str(exc).splitlines()[0]
    except Exception as exc:  # noqa: BLE001
        result.reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
    result.seconds = time.perf_counter() - start
    return result
