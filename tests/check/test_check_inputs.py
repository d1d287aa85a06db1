"""Inputs generated from the graph, right for a decoder, and the user's own feeds."""

from __future__ import annotations

import numpy as np
from check_files import preset_file
from onnx import TensorProto, helper, numpy_helper

from rope_export.check import check
from rope_export.check.inputs import InputPlan, find_vocab, stress_cases, user_cases
from rope_export.check.model_file import ModelFile

LIMIT = 2**34


def decoder_file(batch="batch", position_rank=2) -> ModelFile:
    """A graph with a decoder's inputs (names as optimum writes them) and an embedding of 50 rows."""
    positions = [3, batch, "sequence_length"] if position_rank == 3 else [batch, "sequence_length"]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, "sequence_length"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, positions),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [batch, "total_sequence_length"]),
        helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT16,
                                      [batch, 2, "past_sequence_length", 8]),
    ]
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["hidden"]),
             helper.make_node("Identity", ["past_key_values.0.key"], ["present"])]
    graph = helper.make_graph(nodes, "decoder", inputs, [
        helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [batch, "sequence_length", 4]),
        helper.make_tensor_value_info("present", TensorProto.FLOAT16, [batch, 2, "past_sequence_length", 8])],
        initializer=[numpy_helper.from_array(np.zeros((50, 4), np.float32), "embed")])
    return ModelFile.open(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_decoder_inputs_from_the_graph():
    mf = decoder_file()
    assert find_vocab(mf) == 50
    plan = InputPlan(position_limit=100, vocab=50)
    cases, notes = stress_cases(mf, plan, LIMIT)
    by_name = {c.name: c for c in cases}
    assert {"prefill", "large-magnitude", "long-sequence", "decode", "decode-end-of-positions"} <= set(by_name)
    assert not notes
    for case in cases:
        f = case.feeds
        batch, seq = f["input_ids"].shape
        past = f["past_key_values.0.key"].shape[2]
        assert f["input_ids"].dtype == np.int64 and 0 <= f["input_ids"].min() and f["input_ids"].max() < 50
        assert f["attention_mask"].shape == (batch, past + seq) and (f["attention_mask"] == 1).all()
        assert f["past_key_values.0.key"].dtype == np.float16 and f["past_key_values.0.key"].shape[1::2] == (2, 8)
        assert np.array_equal(f["position_ids"], case.positions) and case.positions.shape == (batch, seq)
    decode = by_name["decode"]
    past = decode.feeds["past_key_values.0.key"].shape[2]
    assert past == 8 and (decode.positions == past).all()  # positions continue the past
    assert (by_name["decode-end-of-positions"].positions == 99).all()  # the last position of the range
    assert by_name["long-sequence"].feeds["input_ids"].shape == (1, 100)  # long, but within the range
    big = by_name["large-magnitude"].feeds["past_key_values.0.key"].astype(np.float32)
    assert np.abs(big).max() > 6  # 4x activations


def test_static_dims_are_kept_and_three_position_rows():
    mf = decoder_file(batch=1, position_rank=3)
    cases, _ = stress_cases(mf, InputPlan(batch=3, position_limit=64, vocab=50), LIMIT)
    assert all(c.feeds["input_ids"].shape[0] == 1 for c in cases)  # static batch 1 wins over --batch 3
    rows = {c.name: c.feeds["position_ids"] for c in cases}
    assert rows["prefill"].shape[0] == 3 and (rows["prefill"][0] == rows["prefill"][2]).all()  # text: same rows
    varied = rows["mrope-3d-positions"]
    assert not (varied[0] == varied[1]).all() and (varied[0] == np.arange(16)).all()


def test_user_feeds_from_npz_and_a_data_loader_script(tmp_path):
    model = preset_file(cache_len=64)
    mf = ModelFile.open(model)
    feeds = {"hidden_states": np.ones((1, 3, 64), np.float32), "position_ids": np.array([[5, 6, 7]]),
             "past_key": np.zeros((1, 2, 5, 16), np.float32), "past_value": np.zeros((1, 2, 5, 16), np.float32)}
    np.savez(tmp_path / "feeds.npz", **feeds)
    (tmp_path / "loader.py").write_text(
        "import numpy as np\n"
        "def cases():\n"
        "    for start in (0, 60):\n"
        "        yield {'hidden_states': np.ones((2, 4, 64), np.float32),\n"
        "               'position_ids': np.arange(start, start + 4).repeat(2).reshape(4, 2).T.copy(),\n"
        "               'past_key': np.zeros((2, 2, 0, 16), np.float32), 'past_value': np.zeros((2, 2, 0, 16), "
        "np.float32)}\n")
    cases = user_cases([str(tmp_path / "feeds.npz"), f"{tmp_path / 'loader.py'}:cases"], mf)
    assert [c.name for c in cases] == ["feeds.npz", "loader.py", "loader.py#1"]
    assert np.array_equal(cases[0].positions, [[5, 6, 7]]) and cases[2].positions.max() == 63
    report = check(model, ("onnx-reference",), inputs=[str(tmp_path / "feeds.npz"), f"{tmp_path / 'loader.py'}:cases"])
    assert report.passed and report.cases == ["feeds.npz", "loader.py", "loader.py#1"]
    assert "the user's feeds" in report.inputs


def test_both_sides_of_the_original_context_by_a_position_offset():
    """LongRoPE switches at its original context: one decode step on each side, with the same short past."""
    mf = decoder_file()
    cases, _ = stress_cases(mf, InputPlan(position_limit=4096, vocab=50, original_context=1024), LIMIT)
    by_name = {c.name: c for c in cases}
    below, past = by_name["decode-original-context-end"], by_name["decode-past-original-context"]
    assert (below.positions == 1023).all() and (past.positions == 1024).all()
    for case in (below, past):
        assert case.feeds["input_ids"].shape[1] == 1 and case.feeds["past_key_values.0.key"].shape[2] == 8
    # no such case when the original context is the whole range (nothing to switch to)
    cases, _ = stress_cases(mf, InputPlan(position_limit=4096, vocab=50, original_context=4096), LIMIT)
    assert not {"decode-original-context-end", "decode-past-original-context"} & {c.name for c in cases}
