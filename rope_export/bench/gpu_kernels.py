"""The GPU benchmark's runners: each rotates q and k of one case on the device, as a zero-argument
callable enqueued on PyTorch's current stream (CUDA events time it, rope_export.bench.gpu).

* ``ours_per_tensor`` / ``ours_qk``: the TensorRT plugin's kernels through librope_export_cuda.so,
  one launch per tensor / q and k in one launch (``rope_export.kernels.cuda.BoundLaunch``: the arguments are
  built once, each call is one ctypes call);
* ``ours_qk_graph``: that launch captured in a CUDA graph and replayed (decode: no CPU launch cost);
* ``torch_eager`` / ``torch_compile``: transformers' apply_rotary_pos_emb (cos/sin gathered from the
  full-width tables by position, cast to X's dtype, rotate-half) in eager PyTorch / torch.compile;
* ``flashinfer_cos_sin_cache`` / ``flashinfer_pos_ids``: FlashInfer's rope kernels when it imports:
  with the same float32 cos/sin cache (in place), and apply_rope_pos_ids (cos/sin computed from theta
  inside the kernel: not the same math, the standard reference row);
* ``copy``: a device copy of the same number of bytes; ``empty_launch``: one empty kernel launch.

Only torch and the package's torch-only modules are imported (no polygraphy, rich or TensorRT).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

LABELS = {
    "ours_per_tensor": "rope_export kernel, one launch per tensor",
    "ours_qk": "rope_export kernel, q+k in one launch",
    "ours_qk_graph": "rope_export kernel, q+k in one launch, CUDA graph replay",
    "torch_eager": "PyTorch eager (transformers' rotate-half)",
    "torch_compile": "torch.compile of the same",
    "flashinfer_cos_sin_cache": "FlashInfer apply_rope_with_cos_sin_cache_inplace (same fp32 cache)",
    "flashinfer_pos_ids": "FlashInfer apply_rope_pos_ids (cos/sin computed in the kernel)",
    "copy": "device copy of the same bytes",
    "empty_launch": "empty kernel launch (torch.cuda._sleep(0))",
}


@dataclass(frozen=True)
class GpuCase:
    phase: str  # "prefill" | "decode"
    batch: int
    seq: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # X: "float16" | "bfloat16" (| "float32")
    cache_dtype: str = "float32"
    max_pos: int = 8192

    def shape_text(self) -> str:
        return (f"B={self.batch} S={self.seq} Hq={self.q_heads} Hk={self.kv_heads} D={self.head_dim} "
                f"{self.dtype}, {self.cache_dtype} caches")

    def tokens(self) -> int:
        return self.batch * self.seq

    def rope_bytes(self) -> int:
        """Bytes one q+k rotation must move: read and write q and k, read each token's cos/sin row once."""
        x = 2 if self.dtype in ("float16", "bfloat16") else 4
        c = 2 if self.cache_dtype in ("float16", "bfloat16") else 4
        qk = self.tokens() * (self.q_heads + self.kv_heads) * self.head_dim * x
        return 2 * qk + self.tokens() * self.head_dim * c  # cos and sin: half a head each


@dataclass
class Tensors:
    """One case on the device: q [B, S, Hq*D], k [B, S, Hk*D] (FlashInfer's [nnz, H, D] memory), the
    [max_pos, D/2] caches, int64 positions, and an output buffer per tensor."""

    q: object
    k: object
    cos: object
    sin: object
    pos: object
    q_out: object
    k_out: object


def make_tensors(case: GpuCase, seed: int = 0) -> Tensors:
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    dt, ct = getattr(torch, case.dtype), getattr(torch, case.cache_dtype)
    shape_q = (case.batch, case.seq, case.q_heads * case.head_dim)
    shape_k = (case.batch, case.seq, case.kv_heads * case.head_dim)
    q = torch.randn(shape_q, generator=g, device="cuda").to(dt)
    k = torch.randn(shape_k, generator=g, device="cuda").to(dt)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, case.head_dim, 2, device="cuda").double() / case.head_dim))
    angles = torch.arange(case.max_pos, device="cuda").double()[:, None] * inv_freq
    cos, sin = angles.cos().to(ct), angles.sin().to(ct)
    # prefill from position 0; decode far into the cache, one position per sequence
    start = 0 if case.phase == "prefill" else case.max_pos // 2
    pos = (start + torch.arange(case.seq, device="cuda")[None, :] + torch.arange(case.batch, device="cuda")[:, None])
    return Tensors(q, k, cos, sin, pos.long(), torch.empty_like(q), torch.empty_like(k))


def reference_outputs(case: GpuCase, t: Tensors):
    """rope_export.op.reference on the device, in float32 math: what every runner must reproduce."""
    from rope_export.op import reference

    return (reference.rotary_embedding(t.q, t.cos, t.sin, t.pos, num_heads=case.q_heads),
            reference.rotary_embedding(t.k, t.cos, t.sin, t.pos, num_heads=case.kv_heads))


def _transformers_rope(q, k, cos_full, sin_full, pos, q_heads, kv_heads, head_dim):
    """transformers' apply_rotary_pos_emb on [B, S, H, D] views, cos/sin gathered and cast to X's dtype."""
    import torch

    cos = cos_full[pos].to(q.dtype).unsqueeze(2)
    sin = sin_full[pos].to(q.dtype).unsqueeze(2)

    def rotate_half(x):
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
        return torch.cat((-x2, x1), dim=-1)

    qv = q.view(*q.shape[:2], q_heads, head_dim)
    kv = k.view(*k.shape[:2], kv_heads, head_dim)
    return ((qv * cos + rotate_half(qv) * sin).view(q.shape), (kv * cos + rotate_half(kv) * sin).view(k.shape))


def runners(case: GpuCase, t: Tensors) -> tuple[dict[str, Callable[[], object]], dict[str, str], list[str]]:
    """(runners, skipped runner -> reason, notes). A runner returns its (q, k) outputs, or None when it
    has none worth checking (copy, empty launch, in-place reruns)."""
    import torch

    from rope_export.kernels import cuda

    run: dict[str, Callable[[], object]] = {}
    skipped: dict[str, str] = {}
    notes: list[str] = []

    q_out, k_out = torch.empty_like(t.q), torch.empty_like(t.k)
    q_alone = cuda.BoundLaunch(t.q, t.cos, t.sin, t.pos, q_out, q_heads=case.q_heads)
    k_alone = cuda.BoundLaunch(t.k, t.cos, t.sin, t.pos, k_out, q_heads=case.kv_heads)
    run["ours_per_tensor"] = lambda: (q_alone(), k_alone(), (q_out, k_out))[-1]
    q_pair, k_pair = torch.empty_like(t.q), torch.empty_like(t.k)
    pair = cuda.BoundLaunch(t.q, t.cos, t.sin, t.pos, q_pair, t.k, k_pair, q_heads=case.q_heads,
                            k_heads=case.kv_heads)
    pair()
    run["ours_qk"] = lambda: (pair(), (q_pair, k_pair))[-1]
    notes.append("q+k: one launch" if pair.fused else "q+k: q and k could not share a launch (two launches)")
    if case.phase == "decode":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pair()
        run["ours_qk_graph"] = lambda: (graph.replay(), (q_pair, k_pair))[-1]
        run["empty_launch"] = lambda: torch.cuda._sleep(0)

    cos_full = torch.cat((t.cos, t.cos), dim=-1)
    sin_full = torch.cat((t.sin, t.sin), dim=-1)
    args = (t.q, t.k, cos_full, sin_full, t.pos, case.q_heads, case.kv_heads, case.head_dim)
    run["torch_eager"] = lambda: _transformers_rope(*args)
    try:
        compiled = torch.compile(_transformers_rope, dynamic=False)
        compiled(*args)  # compiles here, not inside a timed sample
        run["torch_compile"] = lambda: compiled(*args)
    except Exception as exc:  # noqa: BLE001 - no Triton, an unsupported GPU...: say so, keep the others
        skipped["torch_compile"] = f"torch.compile failed: {str(exc).splitlines()[0][:200]}"

    _flashinfer(case, t, run, skipped)

    src = torch.empty(case.rope_bytes() // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    run["copy"] = lambda: dst.copy_(src) and None
    return run, skipped, notes


def _flashinfer(case, t, run, skipped) -> None:
    try:
        import flashinfer.rope as fr
    except Exception as exc:  # noqa: BLE001 - not installed, or built for another torch/CUDA
        reason = f"flashinfer does not import here ({type(exc).__name__}: {str(exc).splitlines()[0][:150]})"
        skipped["flashinfer_cos_sin_cache"] = skipped["flashinfer_pos_ids"] = reason
        return
    import torch

    nnz = case.tokens()
    q3 = t.q.view(nnz, case.q_heads, case.head_dim)
    k3 = t.k.view(nnz, case.kv_heads, case.head_dim)
    flat_pos = t.pos.reshape(-1)
    pos32 = flat_pos.int()

    def pos_ids():
        q, k = fr.apply_rope_pos_ids(q3, k3, pos32, interleave=False, rope_theta=10000.0)
        return q.view(t.q.shape), k.view(t.k.shape)

    try:
        pos_ids()
        run["flashinfer_pos_ids"] = pos_ids
    except Exception as exc:  # noqa: BLE001
        skipped["flashinfer_pos_ids"] = f"apply_rope_pos_ids failed: {str(exc).splitlines()[0][:200]}"
    cos_sin = torch.cat((t.cos, t.sin), dim=-1).float().contiguous()  # [max_pos, D]: cos half, sin half
    q2, k2 = t.q.clone().view(nnz, -1), t.k.clone().view(nnz, -1)
    first = [True]

    def cached():  # in place: the first call is checked, later ones rotate the rotated tensors again
        fr.apply_rope_with_cos_sin_cache_inplace(flat_pos, q2, k2, case.head_dim, cos_sin, is_neox=True)
        if first[0]:
            first[0] = False
            return q2.view(t.q.shape).clone(), k2.view(t.k.shape).clone()
        return None

    run["flashinfer_cos_sin_cache"] = cached  # a failure shows in the cross-check's first call
