"""check.layer_ops and check.layer_faults: a layer's ops found in the file and in PyTorch, a layer run again as it
ran, and a defect told from a loss of precision."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from planted import LAYERS, planted_file  # noqa: E402
from test_check_layer_errors import SMALL, fp16_file, next_cache_row_in_layer  # noqa: E402
from test_check_layer_stream import AUTO, OPTIONS, config, feeds  # noqa: E402

from rope_export.check import check  # noqa: E402
from rope_export.check.layer_ops import all_layer_stages  # noqa: E402
from rope_export.check.layer_stream import LayerStream  # noqa: E402
from rope_export.check.layer_weights import RandomWeights  # noqa: E402
from rope_export.check.model_file import ModelFile  # noqa: E402
from rope_export.runtimes.contract_runners import to_numpy  # noqa: E402

LLAMA_OPS = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "rotation (q)",
             "rotation (k)", "attention scores", "softmax", "self_attn.o_proj", "post_attention_layernorm",
             "mlp.gate_proj", "mlp.act_fn", "mlp.up_proj", "mlp.down_proj"]


def test_every_layers_ops_are_found_in_order_with_the_precision_the_file_states():
    mf = ModelFile.open(planted_file("fp16"))
    stages = all_layer_stages(mf.proto.graph, mf.value_type)
    assert sorted(stages) == list(range(LAYERS))
    for ops in stages.values():
        assert [s.name for s in ops] == LLAMA_OPS
        stated = {s.name: s.stated for s in ops}
        assert stated["input_layernorm"] == stated["softmax"] == stated["rotation (k)"] == "float32"
        assert stated["self_attn.q_proj"] == stated["attention scores"] == "float16"
        assert {s.kind for s in ops} == {"norm", "projection", "rotation", "scores", "softmax", "other"}


@contextlib.contextmanager
def _layer_output(layer):
    values = {}
    handle = layer.register_forward_hook(lambda module, args, out: values.setdefault("out", out[0] if isinstance(
        out, tuple) else out))
    try:
        yield values
    finally:
        handle.remove()


def test_a_layer_runs_again_as_it_ran_from_redrawn_random_weights():
    """After the stream, the weights outside the layers are freed; a layer redrawn from its RNG state and run on its
    recorded input and arguments gives the stream's hidden state bit for bit, in both precisions."""
    source = RandomWeights(AUTO, config(False), torch.float16, 0, OPTIONS)
    stream = LayerStream(AUTO, config(False), source, [torch.float32, torch.float16], feeds(), list(range(3)), OPTIONS)
    results = stream.run()
    assert source._outside == {}  # released
    for layer in (0, 2):
        again = stream.rerun_layer(layer, [0, 1], _layer_output)
        for run, redone in zip(results, again, strict=True):
            for case, values in enumerate(redone):
                assert np.array_equal(to_numpy(values["out"]), run.layer_states[case][layer])


def test_a_defect_is_the_files_and_a_precision_loss_is_not_a_defect():
    report = check(next_cache_row_in_layer(fp16_file(), 1), **SMALL)
    (runner,) = report.compared
    fault = runner.fault
    assert fault.layer == 1 and fault.fault == "file" and fault.defect and fault.float32_checked
    assert fault.first.stage.kind == "rotation" and fault.float32_first.stage.kind == "rotation"
    assert "differently from PyTorch, not only less precisely" in report.failure_message()
