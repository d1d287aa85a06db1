"""check never fails a correct file, continued: Meta's complex block, GPT-J's plain graph, Gemma 3.

Each correct file PASSes; the same file with a planted fault (a wrong table row, swapped weights,
a sliding layer rotated with the global layers' base) FAILs.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
import torch
from check_files import copy
from onnx import numpy_helper
from user_blocks import MAX_POS, GPTJGatherBlock, example, swap_weights

from rope_export import cli
from rope_export.check import check

RUNNERS = ("onnx-reference", "cpu-twin", "onnxruntime-cpu")


# -- Meta's complex rotation, caches cut per token from a 512-row freqs_cis ------------------------------

@pytest.fixture(scope="module")
def meta_file(tmp_path_factory) -> onnx.ModelProto:
    pytest.importorskip("llama_models")
    import user_blocks

    path = tmp_path_factory.mktemp("meta") / "meta.onnx"
    assert cli.main(["export", "--module", f"{user_blocks.__file__}:meta_factory", "-o", str(path)]) == 0
    return onnx.load(path)


def _freqs_cis(model: onnx.ModelProto) -> onnx.TensorProto:
    return next(i for i in model.graph.initializer if list(i.dims) == [MAX_POS, 8, 2])


def test_meta_block_passes_within_its_freqs_cis_rows(meta_file):
    rotary = [n for n in meta_file.graph.node if n.domain == "rope_export"]
    assert rotary and all(len(n.input) == 3 for n in rotary)  # per-token caches: no position_ids
    report = check(meta_file, RUNNERS)
    assert report.passed, report.failure_message()
    for r in report.runners:  # onnx-reference is the sweep's golden: no configuration, no cos/sin table
        assert r.status == "pass" and r.sweep.status == ("golden" if r.runner == "onnx-reference" else "pass")
        assert r.sweep.status == "golden" or r.sweep.positions == MAX_POS
    assert {"decode-end-of-positions", "prefill-end-of-positions"} & set(report.cases)
    assert [(t.name, t.rows, t.passed) for t in report.tables] == [(_freqs_cis(meta_file).name, MAX_POS, True)]


@pytest.mark.parametrize("row", [0, 300, MAX_POS - 1])
def test_meta_block_with_a_wrong_freqs_cis_row_fails(meta_file, row):
    model = copy(meta_file)
    table = _freqs_cis(model)
    values = numpy_helper.to_array(table).copy()
    values[row, 3, 1] += 1e-3
    table.CopyFrom(numpy_helper.from_array(values, table.name))
    report = check(model, ("cpu-twin",))
    assert not report.passed
    (bad,) = [t for t in report.tables if not t.passed]
    assert bad.bad_rows == [(row, row)] and bad.against == "a fitted rotation table"


# -- GPT-J's plain graph: onnx.reference on a GatherElements over many positions ------------------------

def test_gptj_gather_block_runs_on_onnx_reference(tmp_path):
    from rope_blocks import export_plain

    model = export_plain(GPTJGatherBlock().eval(), example())
    assert any(n.op_type == "GatherElements" for n in model.graph.node)
    report = check(model, ("onnx-reference", "onnxruntime-cpu"))
    assert report.passed, report.failure_message()
    assert [r.status for r in report.runners] == ["golden", "pass"]
    broken = check(swap_weights(model), ("onnxruntime-cpu",), reference=_saved(model, tmp_path / "plain.onnx"))
    assert not broken.passed and broken.runners[0].status == "FAIL"


def test_gather_elements_of_more_than_64_rows_matches_numpy():
    """The kernel onnx-reference runs GatherElements with: torch.gather's semantics, negative indices too."""
    from rope_export.check.runners import _gather_elements_op

    op = _gather_elements_op()
    rng = np.random.default_rng(0)
    data = rng.standard_normal((2, 300, 6)).astype(np.float32)
    index = rng.integers(-300, 300, (2, 7, 6))
    (got,) = op._run(None, data, index, axis=1)
    want = torch.gather(torch.from_numpy(data), 1, torch.from_numpy(index % 300)).numpy()
    assert np.array_equal(got, want)


def _saved(model, path):
    onnx.save_model(model, path)
    return path


@functools.cache
def gptj_plain() -> tuple[object, onnx.ModelProto]:
    """transformers' GPTJForCausalLM (tiny, 256 positions) exported plainly with torch.onnx, as optimum does."""
    import transformers as tf
    from check_files import _LMWithPast

    from rope_export import hf
    from rope_export.exporting.torch_onnx import quiet_exporter
    from rope_export.hf import hf_io_names

    config = tf.GPTJConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=256, rotary_dim=4,
                           bos_token_id=None, eos_token_id=None)
    model = hf.build_hf_model(config, seed=0)
    generator = torch.Generator().manual_seed(0)
    ids, positions = torch.randint(0, 64, (2, 4), generator=generator), (torch.arange(4) + 3).expand(2, -1)
    past = [torch.randn(2, 4, 3, 8, generator=generator) for _ in range(2)]
    batch, seq, past_len = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past")
    inputs, outputs = hf_io_names(1)
    with torch.no_grad(), quiet_exporter(False):
        plain = torch.onnx.export(_LMWithPast(model), (ids, positions.contiguous(), *past), dynamo=True,
                                  opset_version=18, input_names=inputs, output_names=outputs,
                                  dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 2: past_len},
                                                  {0: batch, 2: past_len})).model_proto
    return config, plain


def test_gptj_plain_file_passes_against_transformers(tmp_path):
    pytest.importorskip("transformers")
    config, plain = gptj_plain()
    config.save_pretrained(tmp_path / "config")
    report = check(plain, ("onnx-reference", "onnxruntime-cpu"), hf_config=tmp_path / "config")
    assert report.passed, report.failure_message()
    assert report.against == "transformers" and [r.status for r in report.runners] == ["pass", "pass"]
    broken = check(swap_weights(plain), ("onnx-reference", "onnxruntime-cpu"), hf_config=tmp_path / "config")
    assert not broken.passed and [r.status for r in broken.runners] == ["FAIL", "FAIL"]


# -- Gemma 3: sliding layers rotate with base 10000, global ones with 1e6 -----------------------------------

@functools.cache
def gemma3_file() -> onnx.ModelProto:
    import transformers as tf

    from rope_export import hf

    config = tf.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], pad_token_id=None, bos_token_id=None,
        eos_token_id=None, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    return hf.export_hf(hf.build_hf_model(config, seed=0)).model


GEMMA_RUNNERS = {None: RUNNERS, "trt-plugin": ("cpu-twin",), "onnx": ("onnxruntime-cpu", "onnx-reference"),
                 "ort": ("onnxruntime-cpu",), "decomposed": ("onnxruntime-cpu",)}


@pytest.mark.parametrize("target", list(GEMMA_RUNNERS))
def test_gemma3_every_lowering_passes_with_each_layer_types_rope(target):
    pytest.importorskip("transformers")
    from rope_export.passes import lower

    model = gemma3_file() if target is None else lower(gemma3_file(), target)
    report = check(model, GEMMA_RUNNERS[target])
    assert report.passed, report.failure_message()
    assert report.against == "transformers"
    if target != "decomposed":  # the sliding layers' nodes and the global layer's: two slices, each swept
        for r in report.runners:
            assert r.sweep.status == "pass" and r.sweep.slices == 2 and r.sweep.positions == 2 * 128


def test_gemma3_metadata_records_each_layers_type():
    pytest.importorskip("transformers")
    from rope_export import hf

    meta = hf.read_hf_metadata(gemma3_file())
    assert meta["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    by_type = meta["rope_extra"]["rope_by_layer_type"]
    assert by_type["full_attention"]["rope_theta"] == 1e6 and by_type["sliding_attention"].get("rope_theta", 1e4) == 1e4


def test_gemma3_sliding_layers_rotated_with_the_global_base_fail():
    """The bug the per-layer parameters guard against, planted in the file: every runner and the sweep FAIL."""
    pytest.importorskip("transformers")
    model = copy(gemma3_file())
    inits = {i.name: i for i in model.graph.initializer}
    (full,) = [n for n in inits if n.endswith("full_attention_inv_freq")]
    (sliding,) = [n for n in inits if n.endswith("sliding_attention_inv_freq")]
    inits[sliding].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(inits[full]), sliding))
    report = check(model, ("cpu-twin", "onnxruntime-cpu"))
    assert not report.passed
    for r in report.runners:
        assert r.status == "FAIL" and r.sweep.status == "FAIL"
        assert "differ from the RoPE configuration" in r.sweep.reason
