"""The TensorRT plugin's CUDA kernels on a GPU, through librope_export_cuda.so (rope_export.kernels.cuda).

Marker ``gpu``: they need a CUDA device, a CUDA build of PyTorch and the CUDA library, and skip
with one reason without them (CI has no GPU; scripts/gpu_check.sh runs them on a GPU machine).
The reference is rope_export.op.reference on the CPU copies of the same tensors; the CPU twin (the
same per-thread code on the host) is a second one. Each case also checks which path the launch
took (vector or scalar), so a test of the scalar path cannot silently test the vector one.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from rope_export.kernels import backend as kernels
from rope_export.kernels import cpu_twin, cuda
from rope_export.kernels.libraries import plugin_dir
from rope_export.op import reference
from rope_export.op.tolerances import tolerance

REASON = cuda.unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"no GPU run: {REASON}")]

DTYPE_PAIRS = [  # (X, caches): the contract's table
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
]


def _case(dtype, cache_dtype, *, layout="bhsd", batch=2, heads=5, seq=7, head_dim=64, rd=0, max_pos=97,
          with_pos=True, seed=0, offset=0):
    """CUDA tensors; ``offset`` elements shift X (and the output) off 16-byte alignment."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq, head_dim) if layout == "bhsd" else (batch, seq, heads * head_dim)
    x = torch.randn(int(torch.tensor(shape).prod()) + offset, generator=g).to(dtype)[offset:].view(shape)
    half = (rd or head_dim) // 2
    rows = (max_pos,) if with_pos else (batch, seq)
    angle = torch.rand(*rows, half, generator=g) * 6.283
    cos, sin = angle.cos().to(cache_dtype), angle.sin().to(cache_dtype)
    pos = torch.randint(-3, max_pos + 3, (batch, seq), generator=g) if with_pos else None  # some outside
    attrs = dict(num_heads=heads if layout == "bsd" else 0, rotary_embedding_dim=rd)
    dev = [t.cuda() if t is not None else None for t in (x, cos, sin, pos)]
    if offset:  # keep the misalignment on the device too
        flat = torch.empty(x.numel() + offset, dtype=dtype, device="cuda")
        dev[0] = flat[offset:].view(shape).copy_(dev[0])
    return (x, cos, sin, pos), dev, attrs


def _expected(cpu, attrs, interleaved):
    x, cos, sin, pos = cpu
    return reference.rotary_embedding(x, cos, sin, pos, interleaved=interleaved, **attrs)


@pytest.mark.parametrize("dtype, cache_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bsd"])
@pytest.mark.parametrize("head_dim, rd", [(64, 0), (64, 32), (80, 36)])
@pytest.mark.parametrize("with_pos", [True, False])
def test_every_variant_matches_the_reference(dtype, cache_dtype, interleaved, layout, head_dim, rd, with_pos):
    cpu, dev, attrs = _case(dtype, cache_dtype, layout=layout, head_dim=head_dim, rd=rd, with_pos=with_pos)
    expected = _expected(cpu, attrs, interleaved)
    for force_scalar in (False, True):
        out, plan = cuda.rotary_embedding(*dev, interleaved=interleaved, force_scalar=force_scalar, **attrs)
        torch.cuda.synchronize()
        assert tolerance("op", str(dtype)).allclose(out.cpu().float(), expected.float())
        # 16-byte vectors: whole vectors of rotated pairs and of tail channels (rd 36: 18 pairs -> scalar)
        vec = 4 if dtype == torch.float32 else 8
        half = (rd or head_dim) // 2
        vector_possible = half % (vec // 2 if interleaved else vec) == 0 and (head_dim - (rd or head_dim)) % vec == 0
        assert plan.vectorized == (vector_possible and not force_scalar)
        twin, twin_plan = cpu_twin.run(*cpu, interleaved=interleaved, force_scalar=force_scalar, **attrs)
        assert twin_plan == plan  # the GPU launched the grid the twin walked
        assert tolerance("op", str(dtype)).allclose(out.cpu().float(), twin.float())


@pytest.mark.parametrize("dtype, cache_dtype", DTYPE_PAIRS)
def test_misaligned_tensors_take_the_scalar_path_and_match(dtype, cache_dtype):
    cpu, dev, attrs = _case(dtype, cache_dtype, offset=1)
    assert dev[0].data_ptr() % 16 != 0
    out, plan = cuda.rotary_embedding(*dev, **attrs)
    torch.cuda.synchronize()
    assert not plan.vectorized and out.data_ptr() % 16 == 0
    assert tolerance("op", str(dtype)).allclose(out.cpu().float(), _expected(cpu, attrs, False).float())
    misaligned_out = torch.empty(out.numel() + 1, dtype=dtype, device="cuda")[1:].view(out.shape)
    cuda.rotary_embedding(*[t.contiguous() for t in dev[:3]], dev[3], out=misaligned_out, **attrs)
    torch.cuda.synchronize()
    assert torch.equal(misaligned_out.cpu(), out.cpu())


@pytest.mark.parametrize("dtype, cache_dtype", DTYPE_PAIRS)
def test_positions_outside_the_cache_pass_the_token_through_bit_for_bit(dtype, cache_dtype):
    cpu, dev, attrs = _case(dtype, cache_dtype, max_pos=16)
    x, _, _, pos = dev
    pos[0, 0], pos[0, 1], pos[1, 2] = -1, 16, 2**40
    x[0, :, 0, 0], x[0, :, 1, 1], x[1, :, 2, 5] = float("nan"), float("inf"), -float("inf")
    out, _ = cuda.rotary_embedding(*dev, **attrs)
    torch.cuda.synchronize()
    for b, s in ((0, 0), (0, 1), (1, 2)):
        got, original = out[b, :, s].cpu(), x[b, :, s].cpu()
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           original.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_the_binding_picks_the_backend_by_device():
    cpu, dev, attrs = _case(torch.float16, torch.float32)
    on_gpu, gpu_plan = kernels.run(*dev, **attrs)  # CUDA tensors: the CUDA kernels
    on_cpu, cpu_plan = kernels.run(*cpu, **attrs)  # CPU tensors: the twin
    torch.cuda.synchronize()
    assert on_gpu.device.type == "cuda" and on_cpu.device.type == "cpu" and gpu_plan == cpu_plan
    assert tolerance("op", "float16").allclose(on_gpu.cpu().float(), on_cpu.float())
    with pytest.raises(ValueError, match="rope_export.kernels.cuda.rotary_embedding"):
        cpu_twin.run(*dev, **attrs)


def test_q_and_k_in_one_launch_equal_two_launches():
    cpu, dev, attrs = _case(torch.bfloat16, torch.float32, layout="bsd", heads=32, seq=33)
    kcpu, kdev, kattrs = _case(torch.bfloat16, torch.float32, layout="bsd", heads=8, seq=33, seed=1)
    q, cos, sin, pos = dev
    k = kdev[0]
    q_out, k_out, fused = cuda.rotary_embedding_qk(q, k, cos, sin, pos, q_heads=32, k_heads=8)
    assert fused
    q_one, _ = cuda.rotary_embedding(q, cos, sin, pos, num_heads=32)
    k_one, _ = cuda.rotary_embedding(k, cos, sin, pos, num_heads=8)
    torch.cuda.synchronize()
    assert torch.equal(q_out, q_one) and torch.equal(k_out, k_one)
    # A pair that cannot share a kernel (k misaligned: scalar path) still runs, in two launches.
    k_mis = torch.empty(k.numel() + 1, dtype=k.dtype, device="cuda")[1:].view(k.shape).copy_(k)
    _, k_out2, fused2 = cuda.rotary_embedding_qk(q, k_mis, cos, sin, pos, q_heads=32, k_heads=8)
    torch.cuda.synchronize()
    assert not fused2 and torch.equal(k_out2, k_one)


def test_work_runs_on_the_current_non_default_stream():
    cpu, dev, attrs = _case(torch.float16, torch.float32, seq=64, heads=16)
    x, cos, sin, pos = dev
    side = torch.cuda.Stream()
    fresh = torch.randn(x.shape, device="cuda").half()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # keep the side stream busy
        x.copy_(fresh)  # ordered after the sleep, on the side stream
        out = torch.ops.rope_export.rotary_embedding(x, cos, sin, pos)
    assert not side.query()  # still working: nothing waited for the side stream
    side.synchronize()
    expected = reference.rotary_embedding(fresh.cpu(), *cpu[1:3], cpu[3])
    assert tolerance("op", "float16").allclose(out.cpu().float(), expected.float())


def test_torch_op_runs_the_plugin_kernel_on_cuda(monkeypatch):
    calls = []
    real = cuda.rotary_embedding
    monkeypatch.setattr(cuda, "rotary_embedding", lambda *a, **k: calls.append(1) or real(*a, **k))
    cpu, dev, attrs = _case(torch.bfloat16, torch.float32, layout="bsd")
    out = torch.ops.rope_export.rotary_embedding(*dev, False, attrs["num_heads"], 0)
    torch.cuda.synchronize()
    assert calls == [1]
    assert tolerance("op", "bfloat16").allclose(out.cpu().float(), _expected(cpu, attrs, False).float())


def test_cuda_graph_replays_the_launch():
    cpu, dev, attrs = _case(torch.float16, torch.float32, layout="bsd", batch=64, seq=1, heads=32, head_dim=128)
    q, cos, sin, pos = dev
    out = torch.empty_like(q)
    launch = cuda.BoundLaunch(q, cos, sin, pos, out, q_heads=32)
    launch()  # warm up (module load) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert tolerance("op", "float16").allclose(out.cpu().float(), _expected(cpu, attrs, False).float())


def test_more_than_2_31_elements():
    free, _ = torch.cuda.mem_get_info()
    heads, seq, head_dim = 32, 2**20 // 2 + 7, 128  # 2^31 + 28672 fp16 elements: 4 GiB in, 4 GiB out
    if free < 10 * 2**30:
        pytest.skip(f"needs 10 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    x = torch.randn(1, seq, heads * head_dim, device="cuda", dtype=torch.float16)
    assert x.numel() > 2**31
    max_pos = 4096
    angle = torch.rand(max_pos, head_dim // 2, device="cuda") * 6.283
    pos = torch.arange(seq, device="cuda").remainder(max_pos + 5).view(1, seq)  # some past the cache
    out, _ = cuda.rotary_embedding(x, angle.cos(), angle.sin(), pos, num_heads=heads)
    torch.cuda.synchronize()
    for start in (0, seq // 2, seq - 9):  # first, middle and last tokens (past 2^31 elements)
        sl = slice(start, start + 9)
        expected = reference.rotary_embedding(x[:, sl].cpu(), angle.cos().cpu(), angle.sin().cpu(),
                                              pos[:, sl].cpu(), num_heads=heads)
        assert tolerance("op", "float16").allclose(out[:, sl].cpu().float(), expected.float())


def test_compute_sanitizer_memcheck_sweep_is_clean():
    import shutil

    tool = shutil.which("compute-sanitizer")
    driver = plugin_dir() / "rope_export_cuda_sanitize"
    if tool is None or not driver.is_file():
        pytest.skip("compute-sanitizer or build/plugins/rope_export_cuda_sanitize missing")
    proc = subprocess.run([tool, "--tool", "memcheck", "--error-exitcode", "1", str(driver)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr
    assert ", 0 mismatches against the CPU twin" in proc.stdout
