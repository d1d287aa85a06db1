"""onnxruntime in consecutive pieces (``rope_export.check.pieces``) computes what one session computes.

The pieces are compared with one session on the same file and the same stress cases: transformers
exports of five families and their lowerings, fp32 and fp16, a hand-built graph with a subgraph.
To the bit wherever onnxruntime runs the same kernels on both sides; where it does not, the
difference is named: a fusion that spans a cut (GPT-J's decomposed tanh-GELU and residual Add
before a LayerNormalization are fused in one session, not across pieces), and half-precision
values that one session keeps in float32 between two nodes without an fp16 kernel while a cut
rounds them to the fp16 the file declares. onnx.reference, which has neither, runs the same
pieces to the bit in fp16 too.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("transformers")

from check_files import COMMON, FAMILIES, TARGETS, copy, hf_file, preset_file  # noqa: E402

from rope_export.check import check  # noqa: E402
from rope_export.check.inputs import InputPlan, stress_cases  # noqa: E402
from rope_export.check.model_file import ModelFile  # noqa: E402
from rope_export.check.pieces import (  # noqa: E402
    Piece,
    StreamedRunner,
    constant_values,
    plan_pieces,
    session_costs,
    topological_order,
)
from rope_export.check.runners import Limits, Skip, make_runner, ort_cpu_bytes  # noqa: E402
from rope_export.exporting.precision import MARK  # noqa: E402

BASIC = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # no fusion of several nodes into one kernel


def session_bytes(model_or_graph) -> int:
    """What one onnxruntime CPU session on the whole graph takes, on paper (the plan's own costs)."""
    graph = getattr(model_or_graph, "graph", model_or_graph)
    return sum(session_costs(graph).values())


def cases_for(model: onnx.ModelProto, limit: int = 32):
    cases, _ = stress_cases(ModelFile.open(model), InputPlan(position_limit=limit, vocab=64), 2**30)
    return cases


def ort_session(level=None):
    def open_session(data, folder):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if level is not None:
            options.graph_optimization_level = level
        return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    return open_session


def reference_session(data, folder):
    from onnx.reference import ReferenceEvaluator

    from rope_export.op.onnx_op import rotary_numpy
    from rope_export.runtimes.contract_runners import rotary_ops

    return ReferenceEvaluator(onnx.load_from_string(data), new_ops=rotary_ops(rotary_numpy))


def one_and_pieces(model: onnx.ModelProto, budget: int, open_session, cases):
    """Outputs of one session and of the pieces, per case; and the pieces."""
    names = [o.name for o in model.graph.output]
    whole = open_session(model.SerializeToString(), None)
    want = [dict(zip(names, whole.run(names, case.feeds), strict=True)) for case in cases]
    pieces = plan_pieces(model.graph, budget)
    got, _ = StreamedRunner(model, None, pieces, open_session).run_cases(cases)
    return want, got, pieces


def bit_equal(want, got) -> bool:
    """Every output of every case equal to the bit (same dtype and shape, NaN where NaN)."""
    for w, g in zip(want, got, strict=True):
        for name in w:
            a, b = np.asarray(w[name]), np.asarray(g[name])
            assert a.dtype == b.dtype and a.shape == b.shape, name
            if a.tobytes() != b.tobytes():
                return False
    return True


def assert_close(want, got, ulps: int = 4) -> None:
    """Every output within a few units of the last place at the output's own scale (its largest value):
    roundings at the cuts, not a different computation."""
    for w, g in zip(want, got, strict=True):
        for name in w:
            a, b = np.asarray(w[name]), np.asarray(g[name])
            scale = np.spacing(np.abs(a).max()).astype(np.float64)
            err = np.abs(a.astype(np.float64) - b.astype(np.float64)).max()
            assert err <= ulps * scale, f"{name}: {err} is more than {ulps} ulps ({scale}) of its largest value"


def lowered(family: str, target: str | None) -> onnx.ModelProto:
    """The file as onnxruntime runs it (a custom-op file lowered to the standard op, as check does)."""
    from rope_export.passes import lower

    return lower(hf_file(family), "onnx") if target is None else hf_file(family, target)


@functools.cache
def llama_3_layers_fp16() -> onnx.ModelProto:
    import transformers

    from rope_export import hf

    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=2)
    return hf.export_hf(hf.build_hf_model(config, dtype="fp16", seed=0)).model


# -- the plan ------------------------------------------------------------------------------------

@pytest.mark.parametrize("parts", [2, 3, 8, 1000])
def test_the_plan_runs_every_node_once_in_order_within_the_budget(parts):
    model = lowered("llama", "onnx")
    graph = model.graph
    budget = session_bytes(graph) // parts
    pieces = plan_pieces(graph, budget)
    assert [k for p in pieces for k in p.nodes] == topological_order(graph)  # every node once, in order
    assert len(pieces) >= min(parts, 2)
    made = {i.name for i in graph.input}
    tensors = {t.name: t for t in graph.initializer}
    for piece in pieces:
        assert set(piece.inputs) <= made, "a piece reads a value no earlier piece made"
        weighted = [k for k in piece.nodes if any(n in tensors for n in graph.node[k].input)]
        assert piece.session_bytes <= budget or len(weighted) == 1  # only a node too big alone exceeds it
        assert piece.session_bytes == sum(session_costs(graph)[n] for n in piece.initializers)
        made |= set(piece.outputs)
    assert {o.name for o in graph.output} <= made


def test_cuts_fall_between_layers_without_reading_names():
    """With a third of the weights per piece, each cut lands where a decoder layer (or the final norm) begins,
    or between the final norm and the head: where the fewest values cross."""
    graph = llama_3_layers_fp16().graph
    pieces = plan_pieces(graph, session_bytes(graph) // 3 + 1)
    assert len(pieces) >= 3
    made_by = {out: node for node in graph.node for out in node.output}

    def stated(node):  # a node of a norm written with its float32 statistics in the types (exporting.precision)
        return any(p.key == MARK for p in node.metadata_props)

    last_norm = max(k for k, node in enumerate(graph.node) if node.op_type == "RMSNormalization" or stated(node))
    for piece in pieces[1:]:
        first = graph.node[piece.nodes[0]]
        if first.op_type == "RMSNormalization" or (first.op_type == "Cast" and stated(first)):
            continue  # a norm begins here: a decoder layer or the final norm
        # the head alone, reading only the final norm's output
        assert piece is pieces[-1] and piece.inputs == [graph.node[last_norm].output[0]]
        assert made_by[first.input[0]] is graph.node[last_norm]


# -- equal to one session ------------------------------------------------------------------------

@pytest.mark.parametrize("target", [None, *(t for t in TARGETS if t != "trt-plugin")])
@pytest.mark.parametrize("family", FAMILIES)
def test_pieces_equal_one_session_to_the_bit_fp32(family, target):
    model = lowered(family, target)
    cases = cases_for(model)
    budget = session_bytes(model) // 6
    want, got, pieces = one_and_pieces(model, budget, ort_session(BASIC), cases)
    assert len(pieces) >= 4 and bit_equal(want, got)
    # onnxruntime's default optimizations: the same, but where a fusion spans a cut (GPT-J's GELU and
    # Add + LayerNormalization are fused in one session, not across pieces): within rounding there
    for parts in (6, 40):
        want, got, _ = one_and_pieces(model, session_bytes(model) // parts, ort_session(), cases)
        if family == "gptj":
            assert_close(want, got)
        else:
            assert bit_equal(want, got)


def preset_fp16(target: str | None) -> onnx.ModelProto:
    from rope_export.passes import lower

    return preset_file("fp16", 64) if target is None else lower(preset_file("fp16", 64), target)


@pytest.mark.parametrize("target", [None, *(t for t in TARGETS if t != "ort")])  # onnx.reference: no contrib ops
def test_onnx_reference_runs_the_pieces_to_the_bit_in_fp16(target):
    model = preset_fp16(target)
    cases = cases_for(model, 64)[:3]
    want, got, pieces = one_and_pieces(model, session_bytes(model) // 3, reference_session, cases)
    assert len(pieces) >= 3 and bit_equal(want, got)


@pytest.mark.parametrize("target", ["onnx", "ort", "decomposed"])
def test_onnxruntime_pieces_match_one_session_in_fp16(target):
    model = preset_fp16(target)
    cases = cases_for(model, 64)
    want, got, pieces = one_and_pieces(model, session_bytes(model) // 3, ort_session(), cases)
    assert len(pieces) >= 3
    assert_close(want, got)


def test_fp16_pieces_differ_from_one_session_by_the_roundings_at_the_cuts_only():
    model = llama_3_layers_fp16()
    cases = cases_for(model)
    from rope_export.passes import lower

    model = lower(model, "onnx")
    budget = session_bytes(model) // 3 + 1
    want, got, pieces = one_and_pieces(model, budget, reference_session, cases[:2])
    assert bit_equal(want, got)  # the same pieces, run by onnx.reference: to the bit
    want, got, pieces = one_and_pieces(model, budget, ort_session(), cases)
    assert len(pieces) >= 3 and not bit_equal(want, got)
    assert_close(want, got)


def test_a_subgraph_reading_values_of_an_earlier_piece():
    """An If whose branches read an outer value made in an earlier piece and an outer weight."""
    rng = np.random.default_rng(0)
    w = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), f"w{i}")
         for i, shape in enumerate([(8, 8), (8,), (8, 8)])]
    branch = lambda op, name: helper.make_graph(  # noqa: E731
        [helper.make_node(op, ["a", "w1"], [f"{name}_out"])], name, [],
        [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["a"]),
             helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("MatMul", ["b", "w2"], ["c"]),
             helper.make_node("If", ["flag"], ["d"], then_branch=branch("Add", "then"),
                              else_branch=branch("Sub", "other")),
             helper.make_node("Add", ["c", "d"], ["y"])]
    graph = helper.make_graph(nodes, "if", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8]),
                                            helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], initializer=w)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    one_weight = session_costs(graph)["w0"]
    pieces = plan_pieces(graph, one_weight)  # one weight per piece
    if_piece = next(p for p in pieces if 3 in p.nodes)
    assert "a" in if_piece.inputs and "w1" in if_piece.initializers
    x = rng.standard_normal((2, 8)).astype(np.float32)
    cases = [type("Case", (), {"feeds": {"x": x, "flag": np.array(flag)}})() for flag in (True, False)]
    want, got, _ = one_and_pieces(model, one_weight, ort_session(), cases)
    assert bit_equal(want, got) and not np.array_equal(got[0]["y"], got[1]["y"])


# -- check uses it -------------------------------------------------------------------------------

def external_llama(tmp_path):
    """(path, ModelFile) of the tiny Llama saved with its weights in external data."""
    path = tmp_path / "llama.onnx"
    onnx.save_model(copy(hf_file("llama")), path, save_as_external_data=True, location="llama.onnx.data",
                    size_threshold=1024)
    return path, ModelFile.open(path)


def test_check_runs_onnxruntime_in_pieces_when_one_session_would_not_fit(tmp_path):
    path, mf = external_llama(tmp_path)
    runner, note = make_runner("onnxruntime-cpu", mf, limits=Limits(memory=ort_cpu_bytes(mf) - 1))
    assert isinstance(runner, StreamedRunner) and "pieces, one session each" in note
    assert "more than the" in note and "--memory-limit" in note
    runner, _ = make_runner("onnxruntime-cpu", mf, limits=Limits(memory=ort_cpu_bytes(mf)))
    assert not isinstance(runner, StreamedRunner)  # one session where it fits
    largest_node = max(session_costs(mf.proto.graph).values())
    with pytest.raises(Skip, match=r"even run in pieces one node's weights take .* more than the"):
        make_runner("onnxruntime-cpu", mf, limits=Limits(memory=largest_node - 1))

    messages = []
    report = check(path, ("onnxruntime-cpu",), piece_limit_gb=ort_cpu_bytes(mf) / 4 / 2**30, sweep=False,
                   progress=messages.append)
    assert report.passed, report.failure_message()
    ort_report = report.runners[0]
    assert report.against == "transformers" and ort_report.status == "pass" and ort_report.max_abs < 1e-4
    assert "run in" in ort_report.reason and "--piece-limit" in ort_report.reason
    assert "of values kept between pieces" in ort_report.reason
    assert any(f"running {len(report.cases)} cases" in m and "pieces, one session each" in m
               for m in messages)  # the progress line
    opened = [m for m in messages if ": piece " in m and "opening a session" in m]
    assert len(opened) >= 4 and opened[0].startswith("[1/1] onnxruntime-cpu: piece 1/")
    # the same file in one session: the same numbers (Llama: no fusion spans a cut)
    whole = check(path, ("onnxruntime-cpu",), sweep=False).runners[0]
    assert "pieces" not in whole.reason
    for case, stats in whole.cases.items():
        assert [s.max_abs for s in stats] == [s.max_abs for s in ort_report.cases[case]]


def test_check_runs_the_reference_runners_in_pieces_with_the_same_numbers(tmp_path):
    """onnx.reference and the CPU twin hold a file about twice over (its ModelProto and the evaluator's arrays):
    above --piece-limit/--memory-limit they run piece by piece, each piece's weights loaded alone, and compute what
    the whole file in memory computes, to the bit."""
    path, mf = external_llama(tmp_path)
    runner, note = make_runner("onnx-reference", mf, limits=Limits(memory=ort_cpu_bytes(mf) - 1))
    assert isinstance(runner, StreamedRunner) and "each piece's weights loaded alone" in note
    names = ("onnx-reference", "cpu-twin")
    pieces = check(path, names, piece_limit_gb=ort_cpu_bytes(mf) / 4 / 2**30, sweep=False)
    whole = check(path, names, sweep=False)
    assert pieces.passed and whole.passed, pieces.failure_message()
    for in_pieces, at_once in zip(pieces.runners, whole.runners, strict=True):
        assert "pieces" in in_pieces.reason and "pieces" not in at_once.reason
        assert in_pieces.cases.keys() == at_once.cases.keys() and in_pieces.cases
        for case, stats in at_once.cases.items():
            assert [s.max_abs for s in stats] == [s.max_abs for s in in_pieces.cases[case]]


def test_values_of_the_weights_alone_are_held_once_for_every_case():
    """A Transpose of a weight (a tied embedding's, for the head) computed in one piece and read in a later one is
    the same in every case: held once, not once per case; what depends on the inputs is each case's own."""
    rng = np.random.default_rng(0)
    w = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), f"w{i}") for i in range(2)]
    nodes = [helper.make_node("Transpose", ["w1"], ["w1_t"]),
             helper.make_node("Shape", ["w0"], ["w0_shape"]),
             helper.make_node("MatMul", ["x", "w0"], ["a"]),
             helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("MatMul", ["b", "w1_t"], ["y"])]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8]),
                               helper.make_tensor_value_info("w0_shape", TensorProto.INT64, [2])], initializer=w)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    sizes = dict(weight_bytes=0, session_bytes=0)
    pieces = [Piece(nodes=[0, 1, 2], inputs=["x"], outputs=["w1_t", "w0_shape", "a"], initializers=["w0", "w1"],
                    **sizes),
              Piece(nodes=[3, 4], inputs=["a", "w1_t"], outputs=["y"], initializers=[], **sizes)]
    assert constant_values(graph, pieces) == {"w1_t", "w0_shape"}
    xs = [rng.standard_normal((2, 8)).astype(np.float32) for _ in range(3)]
    cases = [type("Case", (), {"feeds": {"x": x}})() for x in xs]
    runner = StreamedRunner(model, None, pieces, ort_session(), "onnxruntime-cpu")
    outputs, _ = runner.run_cases(cases)
    for x, out in zip(xs, outputs, strict=True):
        assert np.allclose(out["y"], np.maximum(x @ numpy_helper.to_array(w[0]), 0) @ numpy_helper.to_array(w[1]).T,
                           atol=1e-5)
    # between the pieces: the transposed weight once and each case's own activation
    assert runner.kept_bytes == 8 * 8 * 4 + 2 * 8 + 3 * 2 * 8 * 4


def test_the_plan_refuses_a_cycle():
    from rope_export.check.model_file import CheckError

    nodes = [helper.make_node("Relu", ["b"], ["a"]), helper.make_node("Relu", ["a"], ["b"])]
    graph = helper.make_graph(nodes, "cycle", [], [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])])
    with pytest.raises(CheckError, match="has a cycle"):
        plan_pieces(graph, 1)
