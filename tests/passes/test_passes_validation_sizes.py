"""``lower`` checks each emitted node on a small input derived from the node, not the file's static shape (issue 40).

onnxruntime's own ``RotaryEmbedding_RejectsHiddenSizeOverflow`` vectors (/work/shared/reference-vectors/onnxruntime,
transcribed from its tests) have a static X of [B, 32768 heads, 1 position, 65536 channels]: 2**31 elements per
sequence. Before the fix ``lower`` fed the validation run X at that shape (with B = 2, 16 GiB, and 32 GiB of float64
for the expected output). Now the run takes 2 heads and at most 2 sequences; the memory it allocates is measured
(tracemalloc for numpy and Python, the resident set for onnxruntime), and the lowered node is still run once.
"""

from __future__ import annotations

import json
import threading
import tracemalloc
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from rope_export.common.steps import rss_bytes
from rope_export.op.contract import DOMAIN, OP_VERSION, RotaryAttrs
from rope_export.op.onnx_op import make_rotary_node
from rope_export.passes import LoweringLog, lower

VECTORS = Path("/work/shared/reference-vectors/onnxruntime/ort_cases.json")
CASES = ("llm/RotaryEmbedding_RejectsHiddenSizeOverflow", "contrib/ContribRotaryEmbedding_RejectsHiddenSizeOverflow")
MB = 2**20


def ort_case(name: str) -> dict:
    if not VECTORS.is_file():
        pytest.skip(f"{VECTORS} is not on this machine (onnxruntime's transcribed test vectors)")
    return next(case for case in json.loads(VECTORS.read_text())["cases"] if case["name"] == name)


def overflow_model(case: dict, batch: int) -> onnx.ModelProto:
    """The vector's node as a rope_export node over graph inputs of its static shapes, X [B, N, S, H]."""
    _, heads, seq, head = case["x_shape"]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, heads, seq, head])
    if case["pos_shape"] is None:  # per-token caches [B, S, H/2]
        caches = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, seq, head // 2]) for n in ("cos", "sin")]
        inputs, pos = [x, *caches], None
    else:  # contrib: [max_pos, H/2] caches; its one-offset position_ids become [B, S]
        rows = case["cache_shape"][0]
        caches = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [rows, head // 2]) for n in ("cos", "sin")]
        inputs, pos = [x, *caches, helper.make_tensor_value_info("pos", TensorProto.INT64, [batch, seq])], "pos"
    node = make_rotary_node("x", "cos", "sin", pos, "y", RotaryAttrs(bool(case["attrs"]["interleaved"])), name="rope")
    graph = helper.make_graph([node], "overflow", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, heads, seq, head])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN,
                                                                                                     OP_VERSION)])


def peak_memory(work) -> tuple[object, int, int]:
    """(result, peak bytes traced by tracemalloc, peak growth of the resident set, sampled every millisecond)."""
    start, peak, stop = rss_bytes(), [0], threading.Event()

    def sample():
        while not stop.wait(0.001):
            peak[0] = max(peak[0], rss_bytes() - start)

    sampler = threading.Thread(target=sample, daemon=True)
    tracemalloc.start()
    sampler.start()
    try:
        result = work()
        traced = tracemalloc.get_traced_memory()[1]
    finally:
        stop.set()
        sampler.join()
        tracemalloc.stop()
    return result, traced, peak[0]


@pytest.mark.parametrize("target", ["onnx", "ort", "decomposed", "trt-plugin"])
@pytest.mark.parametrize(("case_name", "batch"), [(CASES[0], 0), (CASES[0], 2), (CASES[1], 2)],
                         ids=["standard-as-transcribed", "standard-batch-2", "contrib-batch-2"])
def test_lowering_onnxruntimes_overflow_vector_allocates_a_few_mb(case_name, batch, target):
    case = ort_case(case_name)
    lower(overflow_model({**case, "x_shape": [0, 4, 1, 8]}, batch), target, validate=True)  # imports, first sessions
    model = overflow_model(case, batch)
    log = LoweringLog()
    lowered, traced, resident = peak_memory(lambda: lower(model, target, log=log, validate=True))  # as `lower` does
    assert traced < 4 * MB, f"numpy and Python allocated {traced / MB:.1f} MB at the peak"  # 2.9 MB measured
    assert resident < 32 * MB, f"the resident set grew by {resident / MB:.1f} MB"
    ran = [note for note in log.notes if note.startswith("ran 1 ")]
    assert ran, log.notes  # the lowered node did run once, on the small input
    assert log.lowered == ["rope"]
    assert not any(n.domain == DOMAIN for n in lowered.graph.node)  # the node was lowered, the shapes kept
    assert [d.dim_value for d in lowered.graph.input[0].type.tensor_type.shape.dim] == [batch, 32768, 1, 65536]


def test_the_small_input_keeps_what_the_node_fixes():
    """3-D X keeps num_heads x head size (both fixed by the node); a 4-D X whose node counts its heads keeps them."""
    from rope_export.passes import validation
    from rope_export.passes._model import to_ir

    def small(shape, attrs, cache=None):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
        model = helper.make_model(helper.make_graph([], "g", [x], [x]))
        return validation._x_shape(to_ir(model)[0].graph.inputs[0], attrs, None, cache, None)

    assert small([4, 4096, 32 * 128], RotaryAttrs(num_heads=32), (4, 4096, 64)) == (2, 5, 4096)
    assert small([1, 32, 3, 128], RotaryAttrs(), (1, 3, 64)) == (1, 2, 3, 128)
    assert small([1, 32, 3, 128], RotaryAttrs(num_heads=32), (1, 3, 64)) == (1, 32, 3, 128)
    assert small(["b", "h", "s", 64], RotaryAttrs(), None) == (2, 2, 5, 64)


def test_fuse_leaves_a_site_too_large_to_run_decomposed_and_says_why():
    """fuse runs a site on its own tensors to tell its form: at a static shape past MAX_PROBE_ELEMENTS it is left
    decomposed, with the reason, instead of allocating the tensors (here 2 x 4 x 2**21 x 8: 512 MB of float32 each)."""
    from test_passes_fuse_rules import Rope, torchscript

    from rope_export.passes import FusionReport, fuse

    model = torchscript(Rope("table"))
    assert len(fuse(model).graph.node) < len(model.graph.node)  # with its dynamic axes it fuses
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        dims[0].dim_value = 2  # batch, and the sequence axis: x [b, H, s, D], position_ids [b, s]
        dims[2 if value.name == "x" else 1].dim_value = 2**21
    report = FusionReport()
    fused, traced, _ = peak_memory(lambda: fuse(model, report=report))
    # the position ids (2 x 2**21 int64, 32 MB, twice while drawn) are made, no tensor of 512 MB
    assert traced < 160 * MB, f"numpy and Python allocated {traced / MB:.1f} MB at the peak"
    assert not any(n.domain == DOMAIN for n in fused.graph.node)
    reasons = report.summary() + " " + " ".join(str(r) for r in report.records.values())
    assert "at the file's static sizes" in reasons and "fuse a file exported with dynamic batch and sequence" in reasons
