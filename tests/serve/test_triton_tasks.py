"""``rope-export package triton`` for an encoder's file (``export --hf`` of an embedder): an embedding service
whose inputs are token ids and their mask and whose output is the embeddings, served by Triton's own server
(nvidia-pytriton's tritonserver, Python backend) on a padded batch and compared with transformers."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_triton import _infer, _pytriton_root, _ready, parse, tritonserver

from rope_export.serve import triton

transformers = pytest.importorskip("transformers")


@pytest.mark.slow  # an export and a server start: 45 s on a 2-core machine
def test_an_embedders_repository_serves_transformers_embeddings_for_a_padded_batch(tmp_path):
    import torch

    from rope_export import hf
    from rope_export.hf.task_export import export_task

    folder = tmp_path / "embedder"
    config = transformers.AutoConfig.for_model("modernbert", vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                                               pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                               sep_token_id=2)
    torch.manual_seed(0)
    reference = transformers.ModernBertModel(config).eval()
    reference.save_pretrained(folder)
    export_task(hf.build_hf_model(folder, model_class="ModernBertModel"), "feature-extraction", tmp_path / "e.onnx")
    packaged = triton.write_repository(tmp_path / "e.onnx", tmp_path / "repo", backend="python", name="embedder",
                                       max_batch=8)
    config_pb = parse(packaged.folder)
    assert config_pb.max_batch_size == 8
    assert [(t.name, list(t.dims)) for t in config_pb.input] == [("input_ids", [-1]), ("attention_mask", [-1])]
    assert [(t.name, list(t.dims)) for t in config_pb.output] == [("last_hidden_state", [-1, 32])]

    ids = np.random.default_rng(0).integers(3, 64, (3, 11))
    mask = np.ones_like(ids)
    mask[1, 7:], mask[2, 3:] = 0, 0  # rows of 11, 7 and 3 tokens, padded on the right
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
    grpcclient = pytest.importorskip("tritonclient.grpc")
    if _pytriton_root() is None:
        pytest.skip("no tritonserver: install nvidia-pytriton (pip install --no-deps --target build/pytriton "
                    "nvidia-pytriton==0.7.0) or set ROPE_EXPORT_PYTRITON; the config was checked against the schema")
    with tritonserver(tmp_path / "repo", tmp_path) as (address, proc, log):
        client = grpcclient.InferenceServerClient(address)
        deadline = time.monotonic() + 120
        while not _ready(client, "embedder"):
            assert proc.poll() is None, f"tritonserver exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"model not ready in 120 s: {log.read_text()[-3000:]}"
            time.sleep(0.5)
        served = _infer(client, "embedder", {"input_ids": ids, "attention_mask": mask}, ["last_hidden_state"])
        client.close()
    got = served["last_hidden_state"]
    print(f"max abs error vs transformers: {np.abs(got - want.numpy()).max():.2e}")
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=1e-4)
