"""A model honestly past protobuf's 2 GB limit, end to end (slow: ``make test-slow``, about 10-15 minutes).

Three Llama-3.1-8B layers with tied embeddings in fp16: 1.18 B parameters, 2.36 GB of weights, the
smallest real-shaped model past 2**31 bytes. Each step runs in its own process, as the scale
benchmark runs it (``rope_export.bench.scale.run_size``): ``export --hf``, ``lower`` to every
target, a plain ``torch.onnx.export`` of the same model and ``fuse`` on it, and ``check`` of the
exported file against transformers. After each step the files are checked: onnx.checker on the
path, the weights past the 2 GB offset are the model's (export) or the input's (lower), the rotary
nodes are where they should be; the check's report says it passed against transformers. The check
runs onnxruntime in pieces of at most 2 GB (``--piece-limit 2``: one session would take about
7 GB), the path an 8B-class file takes on a 24 GB machine.
"""

from __future__ import annotations

import gc
import json
import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from rope_export.bench import scale
from rope_export.files import onnx_files
from rope_export.op import contract

pytestmark = pytest.mark.slow
TWO_GB = 2**31
LAYERS = scale.SIZES["2gb"]["num_hidden_layers"]


def rotary_nodes(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.op_type == contract.OP_TYPE:
            counts[node.domain or "ai.onnx"] = counts.get(node.domain or "ai.onnx", 0) + 1
    return counts


def past_two_gb(path: Path) -> list:
    """The lazily loaded tensors of ``path`` that lie past the 2 GB offset of its data file."""
    tensors = [v.const_value for v in onnx_files.load(path).graph.initializers.values()]
    out = sorted((t for t in tensors if isinstance(t, ir.ExternalTensor) and (t.offset or 0) >= TWO_GB),
                 key=lambda t: t.offset)
    assert out, f"no tensor of {path} lies past the 2 GB offset"
    return out


def assert_is_a_big_external_file(path: Path) -> None:
    [data] = onnx_files.data_files(path)
    assert data.is_file() and data.stat().st_size > TWO_GB, f"{data} should hold more than 2 GB"
    assert path.stat().st_size < 20 * 2**20, f"{path} should hold the graph only"
    onnx.checker.check_model(str(path), full_check=True)


def assert_export_holds_the_models_weights(path: Path, config: Path) -> None:
    """The tensors written past 2 GB equal the weights of the same (seeded) model rebuilt here."""
    from rope_export.hf import build_hf_model

    model = build_hf_model(config, dtype="fp16", seed=0)
    params = [p.detach() for p in model.parameters()]
    for tensor in past_two_gb(path)[-2:]:
        got = torch.from_numpy(tensor.numpy().copy())
        candidates = [p for p in params if p.shape == got.shape]
        candidates += [p.T for p in params if p.dim() == 2 and p.T.shape == got.shape]  # MatMul weights: transposed
        assert any(torch.equal(got, c) for c in candidates), f"{tensor.name} is none of the model's weights"
    del model, params
    gc.collect()


def assert_checked_against_transformers(reports: Path) -> None:
    report = json.loads((reports / "check.json").read_text())
    assert report["passed"] and report["reference"].startswith("transformers Llama (fp16, random weights, seed 0")
    runners = {r["runner"]: r for r in report["runners"]}
    ort = runners["onnxruntime-cpu"]
    assert ort["status"] == "pass" and ort["max_abs_error"] is not None
    pieces = re.search(r"run in (\d+) pieces", ort["reason"])
    assert pieces and int(pieces.group(1)) >= 4, ort["reason"]
    assert {"prefill", "long-sequence", "decode-end-of-positions"} <= set(ort["cases"])
    outputs = {s["output"] for stats in ort["cases"].values() for s in stats}
    assert outputs == {"logits", *(f"present.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value"))}
    for name in ("onnx-reference", "cpu-twin"):  # the whole model stays on disk; every rotary node runs alone
        assert runners[name]["status"] == "skipped" and runners[name]["rotary_sweep"]["status"] == "pass"
        assert runners[name]["rotary_sweep"]["positions"] == scale.SIZES["2gb"]["max_position_embeddings"]


def test_a_model_past_2gb_exports_lowers_fuses_and_checks(tmp_path):
    work = Path(os.environ.get("ROPE_EXPORT_SLOW_DIR") or tmp_path)
    plan = {**scale.weight_plan("2gb"), "work": str(work)}
    assert plan["weight_bytes"] > TWO_GB
    if scale.fits(plan):
        pytest.skip(f"this machine cannot run it now: {scale.fits(plan)}")
    config = work / "2gb-config"
    seen = []

    def after_step(name: str, outputs: list[Path]) -> None:
        seen.append(name)
        if name == "export --hf":
            assert_is_a_big_external_file(outputs[0])
            assert rotary_nodes(outputs[0]) == {contract.DOMAIN: 2 * LAYERS}
            assert_export_holds_the_models_weights(outputs[0], config)
        elif name.startswith("lower "):
            assert_is_a_big_external_file(outputs[0])
            assert contract.DOMAIN not in rotary_nodes(outputs[0])
            source = {v.name: v.const_value for v in onnx_files.load(work / "model.onnx").graph.initializers.values()}
            for tensor in past_two_gb(outputs[0])[-2:]:
                np.testing.assert_array_equal(tensor.numpy(), source[tensor.name].numpy(), err_msg=tensor.name)
        elif name == "plain export":
            assert_is_a_big_external_file(outputs[0])
            assert rotary_nodes(outputs[0]) == {}  # RoPE decomposed: what fuse is for
        elif name == "fuse":
            assert_is_a_big_external_file(outputs[0])
            assert rotary_nodes(outputs[0]) == {contract.DOMAIN: 2 * LAYERS}
        elif name == "check":
            assert_checked_against_transformers(outputs[0])

    result = scale.run_size("2gb", work, builder=False, package=False, check_args=("--piece-limit", "2"),
                            after_step=after_step)
    assert result["status"] == "measured", result.get("reason")
    assert seen == ["warm-up", "plain export", "export --hf", "file copy", *(f"lower {t}" for t in scale.TARGETS),
                    "fuse", "check"]
    assert 0 < result["ratios"]["write_over_copy"]  # the export's write rate against cp's on the same bytes
    check = result["steps"][-1]
    assert check["step"] == "check" and check["note"].startswith("passed against transformers")
    assert any(s["name"].startswith("[3/5] onnxruntime-cpu: piece 1/") for s in result["check_steps"])
    leftovers = sorted(p.name for p in work.iterdir() if p.suffix in (".onnx", ".data", ".tmp"))
    assert leftovers == [], f"files left in {work}: {leftovers}"
