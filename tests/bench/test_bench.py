"""``rope-export bench``: functional checks only, never speed (the machines are shared and noisy).

One ``--smoke`` run (toy shapes, 2 rounds) is shared by the tests: its JSON has every section and
key, its ratios are finite and positive, every runner computes what the baseline computes, the GPU
section says why it was skipped, and the static kernel report reads real nvcc/ptxas output where
nvcc exists. The parsers and the timing loop have their own small tests.
"""

from __future__ import annotations

import json
import math

import pytest

from rope_export import bench, cli
from rope_export.bench import gpu, kernels, timing

ROPE_RUNNERS = {
    "decomposed_plain", "decomposed_lowered", "onnx", "onnx_trusted", "ort", "torch_eager", "copy", "memcpy",
}
BLOCK_FILES = {"plain", "onnx", "onnx_trusted", "ort"}
TWIN_RUNNERS = {"twin", "twin_call_overhead", "copy_1_thread"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = cli.main(["bench", "--smoke", "--out", str(out)])
    return rc, out, json.loads((out / "bench.json").read_text())


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_smoke_run_writes_json_markdown_and_plot(smoke):
    rc, out, results = smoke
    assert rc == 0
    assert results["schema"] == bench.SCHEMA and results["mode"] == "smoke"
    assert set(results["sections"]) == {"rope_alone", "block", "twin", "gpu", "kernels"}
    for key in ("cpu", "logical_cpus", "load_average_1_5_15min", "load_average_end", "torch", "onnxruntime"):
        assert key in results["machine"]
    assert results["settings"]["threads"] == 2
    assert "## 1. RoPE alone" in (out / "bench.md").read_text()
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]  # atomic writes leave nothing behind


def test_rope_alone_ratios_are_finite_and_every_runner_agrees(smoke):
    section = smoke[2]["sections"]["rope_alone"]
    assert {(c["case"]["phase"], c["case"]["dtype"]) for c in section["cases"]} == {
        (p, d) for p in ("prefill", "decode") for d in ("float32", "float16")
    }
    for case in section["cases"]:
        assert set(case["variants"]) == ROPE_RUNNERS
        assert case["bytes"] > 0
        for vid, v in case["variants"].items():
            for key in ("median_ms", "gb_per_s", "speedup_vs_decomposed", "fraction_of_copy"):
                assert _positive(v[key]), (vid, key, v[key])
            if vid not in ("copy", "memcpy"):
                assert v["agrees"], (case["case"], vid, v["max_abs_diff_vs_baseline"])
        assert case["variants"]["decomposed_plain"]["speedup_vs_decomposed"] == 1.0


def test_block_section_counts_nodes_and_rope_share(smoke):
    section = smoke[2]["sections"]["block"]
    assert section["cases"], "the smoke run measures one block"
    for case in section["cases"]:
        assert set(case["variants"]) == BLOCK_FILES
        assert case["custom_op_file_nodes"] > 0
        for vid, v in case["variants"].items():
            assert isinstance(v["nodes"], int) and v["nodes"] > 0
            assert _positive(v["median_ms"]) and _positive(v["speedup_vs_plain"])
            assert v["agrees"], (vid, v["max_abs_diff_vs_plain"])
        for share in case["rope_share"].values():
            assert 0 < share["rope_share"] < 1


def test_twin_section_against_a_copy(smoke):
    section = smoke[2]["sections"]["twin"]
    assert "1 host thread" in section["threads"]
    for case in section["cases"]:
        assert set(case["variants"]) == TWIN_RUNNERS
        twin = case["variants"]["twin"]
        assert twin["agrees"] and twin["vector_path"]
        assert _positive(twin["fraction_of_copy"]) and _positive(twin["gb_per_s"])
        assert _positive(case["variants"]["twin_call_overhead"]["median_ms"])


def test_gpu_section_is_skipped_with_a_reason_without_a_gpu(smoke):
    section = smoke[2]["sections"]["gpu"]
    reason = gpu.unavailable_reason()
    if reason is None:
        pytest.skip("a CUDA GPU is present: the section is measured, not skipped")
    assert section["status"] == "skipped" and section["measured"] is False
    assert section["reason"] == reason and "cases" not in section  # no zeros standing in for figures


def test_goals_are_reported_not_asserted(smoke):
    goals = smoke[2]["goals"]
    names = " ".join(g["goal"] for g in goals)
    assert "4x faster" in names and "within 15%" in names and "CPU twin" in names
    for g in goals:
        assert isinstance(g["met"], bool) and g["where"]


def test_static_report_reads_real_ptxas_output(smoke):
    section = smoke[2]["sections"]["kernels"]
    if kernels.find_tool("nvcc") is None:
        assert section["status"] == "skipped" and "nvcc" in section["reason"]
        return
    assert section["status"] == "measured"
    rows = section["kernels"]
    assert {r["arch"] for r in rows} == {"sm_80", "sm_90"}
    assert len(rows) == 2 * 4 * 5  # 2 archs x (interleaved?, vector?) x 5 dtype pairs
    for r in rows:
        assert r["registers"] > 0 and r["x_dtype"] in ("float32", "float16", "bfloat16")
        assert r["ptx"]["loads_by_bits"] and r["ptx"]["stores_by_bits"]
    summary = section["summary"]
    assert summary["vector_kernels"] == len(rows) // 2
    if kernels.find_tool("cuobjdump") is None:
        assert section["sass"].startswith("skipped: cuobjdump not found")
    else:
        assert all(r["sass"] is not None for r in rows)


def test_parse_ptxas_log():
    log = (
        "ptxas info    : 0 bytes gmem\n"
        "ptxas info    : Compiling entry function '_ZN4rope13rotary_kernelINS_6KernelI6__halffLb0ELb1EEEEEvNS_7Problem"
        "ENS_4PlanE' for 'sm_90'\n"
        "ptxas info    : Function properties for _ZN4rope13rotary_kernel...\n"
        "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 64 registers, used 1 barriers, 2048 bytes smem, 512 bytes cmem[0]\n"
    )
    (row,) = kernels.parse_ptxas(log)
    assert row["arch"] == "sm_90" and row["registers"] == 64 and row["shared_bytes"] == 2048
    assert (row["stack_bytes"], row["spill_store_bytes"], row["spill_load_bytes"]) == (16, 8, 4)
    assert kernels.kernel_variant(row["kernel"]) == {
        "x_dtype": "float16", "cache_dtype": "float32", "interleaved": False, "vector": True,
    }
    bf16 = kernels.kernel_variant("_ZN4rope13rotary_kernelINS_6KernelI13__nv_bfloat16S2_Lb1ELb0EEEEEv")
    assert bf16 == {"x_dtype": "bfloat16", "cache_dtype": "bfloat16", "interleaved": True, "vector": False}


def test_parse_ptx_counts_access_widths():
    ptx = """
.visible .entry _Z1kv(
)
{
    ld.global.nc.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];
    ld.global.nc.v2.u32 {%r5, %r6}, [%rd2];
    ld.global.u64 %rd3, [%rd4];
    st.global.wb.v4.u32 [%rd5], {%r1, %r2, %r3, %r4};
    st.global.wb.u16 [%rd6], %rs1;
}
"""
    entry = kernels.parse_ptx(ptx)["_Z1kv"]
    assert entry["loads_by_bits"] == {"64": 2, "128": 1}
    assert entry["stores_by_bits"] == {"16": 1, "128": 1}


def test_parse_sass_counts_128_bit_global_accesses():
    # The layout of `cuobjdump -sass` (cuobjdump is not on the build machines, so this is a sample
    # of its format: headers, one function, sm_90 descriptors).
    sass = """
Fatbin elf code:
================
arch = sm_90
code version = [1,8]
host = linux
compile_size = 64bit

        code for sm_90
                Function : _ZN4rope13rotary_kernelINS_6KernelIffLb0ELb1EEEEEvNS_7ProblemENS_4PlanE
        .headerflags    @"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*00a0*/                   LDG.E.64 R2, desc[UR4][R4.64] ;
        /*00b0*/                   LDG.E.128.CONSTANT R8, desc[UR4][R6.64] ;
        /*00c0*/                   LDG.E.128.CONSTANT R12, desc[UR4][R10.64] ;
        /*00d0*/                   STG.E.128 desc[UR4][R14.64], R16 ;
        /*00e0*/                   STG.E.U16 desc[UR4][R18.64], R20 ;
        /*00f0*/                   EXIT ;
"""
    (key, entry), = kernels.parse_sass(sass).items()
    assert key == ("_ZN4rope13rotary_kernelINS_6KernelIffLb0ELb1EEEEEvNS_7ProblemENS_4PlanE", "sm_90")
    assert entry["loads_by_bits"] == {"64": 1, "128": 2}
    assert entry["stores_by_bits"] == {"16": 1, "128": 1}


def test_interleaved_rounds_rotate_and_take_medians():
    calls: list[str] = []
    fake = {"a": 0.010, "b": 0.001}

    def clock(fn, inner):
        fn()
        return fake[calls[-1]] * inner

    fns = {name: (lambda n=name: calls.append(n)) for name in fake}
    result = timing.interleaved(fns, rounds=4, target_s=0.005, warmup=0, clock=clock)
    assert result["a"].inner == 1 and result["b"].inner == 5  # 1 ms calls: 5 per 5 ms sample
    assert result["a"].median_s == pytest.approx(0.010) and result["b"].median_s == pytest.approx(0.001)
    rounds = calls[2:]  # after the two calibration calls, each round starts with a different runner
    assert rounds[0::2] == ["a", "b", "a", "b"]


def test_bad_arguments_are_refused():
    assert cli.main(["bench", "--smoke", "--sections", "rope,nope"]) == 2
    assert cli.main(["bench", "--smoke", "--threads", "0"]) == 2


def test_scale_check_note_gives_the_ratio_to_pytorch_and_the_layer_verdict(tmp_path):
    from rope_export.bench.scale import check_note

    stats = [{"output": "logits", "max_abs": 0.03, "ratio_to_pytorch": 0.6},
             {"output": "present.0.key", "max_abs": 0.01, "ratio_to_pytorch": 1.3}]
    report = {"passed": True, "reference": "transformers Llama (fp16, random weights, seed 0), run layer by layer",
              "runners": [{"runner": "onnxruntime-cpu", "status": "pass", "max_abs_error": 0.03,
                           "reason": "run in 13 pieces, one session each", "cases": {"prefill": stats},
                           "error_by_layer": {"errors": [0.1] * 32, "first_outside": None}}]}
    path = tmp_path / "check.json"
    path.write_text(json.dumps(report))
    assert check_note(path) == ("passed against transformers Llama: onnxruntime-cpu pass (max abs 0.03, 13 pieces), "
                                "worst 1.30x PyTorch's own fp error, within PyTorch's envelope at all 32 layers")
