"""Section 1: RoPE alone on onnxruntime CPU, every lowering against the decomposed form.

The models are issue 4's (``rope_export.bench.passes``): transformers' ``x * cos +
rotate_half(x) * sin`` with cos/sin read from a table by ``position_ids`` (the full run also
takes cos/sin computed from ``inv_freq`` in the graph, as transformers exports it), exported by a plain
``torch.onnx.export`` (the baseline, "decomposed: plain torch.onnx export"), then fused into one
rope_export::RotaryEmbedding and lowered to ``onnx``, ``onnx`` with trusted positions, ``ort``
and ``decomposed``. One call rotates q (``q_heads``) and k (``kv_heads``) of a GQA layer, as a
block does. Beside them, in the same rounds: PyTorch eager (the same rotate-half in torch ops,
same thread count) and two copies of the same number of bytes: torch ``copy_`` with the same
thread count, and ``numpy.copyto`` (memcpy) on one thread. ``fraction_of_copy`` is taken against
the faster of the two: on a busy shared machine either can win, and a memory-bound op is held to
the best copy measured, not the worse one.

Bytes of one call: read x, read the cos/sin rows used (one row of rd/2 per token and table),
write the output, for q and for k. A copy moves the same total (reads half, writes half).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np

from rope_export.bench.timing import interleaved, ratio

BASELINE = "decomposed_plain"
COPY = "copy"  # torch copy_ with the runners' thread count
MEMCPY = "memcpy"  # numpy.copyto (memcpy), one thread

# bench_passes.variants() name -> (our id, label)
LOWERED = {
    "decomposed (original)": ("decomposed_plain", "decomposed: plain torch.onnx export (baseline)"),
    "fused -> decomposed": ("decomposed_lowered", "decomposed: our `decomposed` lowering"),
    "fused -> onnx": ("onnx", "onnx: RotaryEmbedding-23 (default lowering)"),
    "fused -> onnx, trusted positions": ("onnx_trusted", "onnx: RotaryEmbedding-23, trusted positions"),
    "fused -> ort": ("ort", "ort: com.microsoft RotaryEmbedding"),
}
TORCH_EAGER = ("torch_eager", "PyTorch eager (rotate-half, torch ops)")
COPY_LABEL = "copy of the same bytes (torch copy_)"
MEMCPY_LABEL = "copy of the same bytes (numpy.copyto = memcpy, 1 thread)"
FUSED_KEY = "fused -> onnx, trusted positions"  # whose cos/sin initializers every runner shares


@dataclass(frozen=True)
class RopeCase:
    phase: str  # "prefill" | "decode"
    batch: int
    seq: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "float16"
    source: str = "table"  # cos/sin gathered from a table ("table") or computed from inv_freq ("computed")

    @property
    def start(self) -> int:
        """First position: past the beginning of the table, decode far into it."""
        return 100 if self.phase == "prefill" else 3000

    def shape_text(self) -> str:
        return f"B={self.batch} S={self.seq} Hq={self.q_heads} Hk={self.kv_heads} D={self.head_dim}"

    def label(self) -> str:
        """e.g. 'prefill float32' (table cos/sin), 'prefill float32, cos/sin computed'."""
        return f"{self.phase} {self.dtype}" + (", cos/sin computed" if self.source == "computed" else "")


def np_dtype(name: str):
    return {"float32": np.float32, "float16": np.float16}[name]


@dataclass
class RopeInputs:
    """One case's tensors (numpy), shared by every runner so all of them compute the same thing."""

    x_q: np.ndarray  # [B, Hq, S, D]
    x_k: np.ndarray  # [B, Hk, S, D]
    position_ids: np.ndarray  # [B, S] int64
    cos_cache: np.ndarray  # [max_pos, D/2], the fused model's table (x's dtype)
    sin_cache: np.ndarray

    def rope_bytes(self) -> int:
        """Bytes one call (q and k) must move: read x and the cos/sin rows used, write the output."""
        tokens = self.position_ids.size
        rows = 2 * tokens * self.cos_cache.shape[1] * self.cos_cache.itemsize
        return 2 * self.x_q.nbytes + 2 * self.x_k.nbytes + 2 * rows


def make_inputs(case: RopeCase, seed: int = 0) -> RopeInputs:
    from onnx import numpy_helper

    rng = np.random.default_rng(seed)
    dt = np_dtype(case.dtype)
    b, s, d = case.batch, case.seq, case.head_dim
    pos = (np.arange(s)[None, :] + case.start + np.arange(b)[:, None]).astype(np.int64)
    table = _variants("table", case.dtype, case.head_dim)[FUSED_KEY]  # the computed source has no table
    inits = {i.name: numpy_helper.to_array(i) for i in table.graph.initializer}
    cos = next(v for k, v in inits.items() if "cos" in k)
    sin = next(v for k, v in inits.items() if "sin" in k)
    return RopeInputs(  # same positions and tables for every runner and source
        x_q=rng.standard_normal((b, case.q_heads, s, d)).astype(dt),
        x_k=rng.standard_normal((b, case.kv_heads, s, d)).astype(dt),
        position_ids=pos,
        cos_cache=np.array(cos, order="C"),  # a writable copy (torch.from_numpy wants one)
        sin_cache=np.array(sin, order="C"),
    )


def rope_models(case: RopeCase) -> dict:
    """bench_passes' variants for this case's cos/sin source, dtype and head_dim."""
    return _variants(case.source, case.dtype, case.head_dim)


@functools.cache
def _variants(source: str, dtype: str, head_dim: int) -> dict:
    from rope_export.bench import passes as bench_passes

    return bench_passes.variants(source, dtype, head_dim)


def torch_rotate_half(x, cos_full, sin_full, position_ids, inv_freq=None):
    """transformers' apply_rotary_pos_emb in torch ops: gather (or, with ``inv_freq``, compute as its
    rotary module does) cos/sin, rotate-half, two Mul and an Add."""
    import torch

    if inv_freq is not None:
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype).unsqueeze(1), emb.sin().to(x.dtype).unsqueeze(1)
    else:
        cos = cos_full[position_ids].unsqueeze(1)
        sin = sin_full[position_ids].unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def full_width_tables(inputs: RopeInputs):
    """[max_pos, D] cos/sin (the half table repeated, as transformers stores it) as torch tensors."""
    import torch

    cos = torch.from_numpy(np.concatenate([inputs.cos_cache, inputs.cos_cache], axis=-1))
    sin = torch.from_numpy(np.concatenate([inputs.sin_cache, inputs.sin_cache], axis=-1))
    return cos, sin


def ort_session(model, threads: int, profile: str | None = None, providers=("CPUExecutionProvider",)):
    """An onnxruntime session with ``threads`` intra-op threads; ``profile``: a file prefix to profile to."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    # Idle intra-op threads sleep instead of spin-waiting: several sessions and torch's own pool
    # take turns on the same cores here, and a spinning pool steals the next runner's cores.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = profile
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, options, providers=list(providers))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def copy_of(nbytes: int, split: tuple[int, ...], device=None) -> Callable[[], object]:
    """A torch copy_ moving ``nbytes`` in total (read + write), one copy per share of ``split``."""
    import torch

    pairs = []
    total = sum(split)
    for share in split:
        n = max(1, round(nbytes * share / total / 2 / 4))  # float32 elements read (and as many written)
        src = torch.randn(n, device=device)
        pairs.append((torch.empty_like(src), src))

    def run():
        for dst, src in pairs:
            dst.copy_(src)

    return run


def memcpy_of(nbytes: int, split: tuple[int, ...]) -> Callable[[], object]:
    """numpy.copyto (a single-thread memcpy) moving ``nbytes`` in total, one copy per share of ``split``."""
    pairs = []
    total = sum(split)
    for share in split:
        n = max(1, round(nbytes * share / total / 2))
        src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
        pairs.append((np.empty_like(src), src))

    def run():
        for dst, src in pairs:
            np.copyto(dst, src)

    return run


def cross_check_tolerance(dtype: str):
    """The decomposed baseline rounds every step in x's dtype, the fused op once: compare at the
    block tolerance (a few ulps of the output's scale), not the op's two-ulp one."""
    from rope_export.op.tolerances import tolerance

    return tolerance("block", dtype)


def measure_case(case: RopeCase, threads: int, rounds: int, say: Callable[[str], None]) -> dict:
    """Build, cross-check and time every runner of one case; returns its JSON-ready result."""
    import torch

    say(f"RoPE alone {case.phase} {case.dtype} {case.source}: exporting and lowering (bench_passes.variants)")
    models = rope_models(case)
    inputs = make_inputs(case)
    feeds_q = {"x": inputs.x_q, "position_ids": inputs.position_ids}
    feeds_k = {"x": inputs.x_k, "position_ids": inputs.position_ids}
    runners: dict[str, Callable[[], object]] = {}
    labels: dict[str, str] = {}
    outputs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key, model in models.items():
        vid, label = LOWERED.get(key, (key, key))
        session = ort_session(model, threads)
        outputs[vid] = (session.run(None, feeds_q)[0], session.run(None, feeds_k)[0])
        runners[vid] = lambda s=session: (s.run(None, feeds_q), s.run(None, feeds_k))
        labels[vid] = label

    tq, tk = torch.from_numpy(inputs.x_q), torch.from_numpy(inputs.x_k)
    pos = torch.from_numpy(inputs.position_ids)
    cos_full, sin_full = full_width_tables(inputs)
    d = case.head_dim
    inv_freq = None
    if case.source == "computed":  # as bench_passes' module holds it: a buffer cast to x's dtype by .to(dtype)
        inv_freq = (1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))).to(tq.dtype)
    vid, label = TORCH_EAGER
    with torch.no_grad(), torch_threads(threads):
        outputs[vid] = (torch_rotate_half(tq, cos_full, sin_full, pos, inv_freq).numpy(),
                        torch_rotate_half(tk, cos_full, sin_full, pos, inv_freq).numpy())
    runners[vid] = lambda: (torch_rotate_half(tq, cos_full, sin_full, pos, inv_freq),
                            torch_rotate_half(tk, cos_full, sin_full, pos, inv_freq))
    labels[vid] = label
    nbytes = inputs.rope_bytes()
    runners[COPY] = copy_of(nbytes, (inputs.x_q.size, inputs.x_k.size))
    labels[COPY] = f"{COPY_LABEL}, {threads} thread(s)"
    runners[MEMCPY] = memcpy_of(nbytes, (inputs.x_q.size, inputs.x_k.size))
    labels[MEMCPY] = MEMCPY_LABEL

    reference = outputs[BASELINE]
    say(f"RoPE alone {case.phase} {case.dtype} {case.source}: timing {len(runners)} runners, "
        f"{rounds} interleaved rounds")
    with torch.no_grad(), torch_threads(threads):
        timings = interleaved(runners, rounds)
    base = timings[BASELINE].median_s
    copy = min(timings[COPY].median_s, timings[MEMCPY].median_s)
    variants = {}
    for vid, timing in timings.items():
        entry = {"label": labels[vid], **timing.to_dict()}
        entry["gb_per_s"] = nbytes / timing.median_s / 1e9
        entry["speedup_vs_decomposed"] = ratio(base, timing.median_s)
        entry["fraction_of_copy"] = ratio(copy, timing.median_s)
        if vid in outputs:
            diff = max(float(np.max(np.abs(o.astype(np.float32) - r.astype(np.float32))))
                       for o, r in zip(outputs[vid], reference, strict=True))
            entry["max_abs_diff_vs_baseline"] = diff
            tol = cross_check_tolerance(case.dtype)
            entry["agrees"] = all(tol.allclose(o, r) for o, r in zip(outputs[vid], reference, strict=True))
        variants[vid] = entry
    return {
        "case": asdict(case),
        "shape": case.shape_text(),
        "bytes": nbytes,
        "threads": threads,
        "cos_sin": case.source,
        "baseline": BASELINE,
        "variants": variants,
    }


def run_section(cases: list[RopeCase], threads: int, rounds: dict[str, int], say: Callable[[str], None]) -> dict:
    results = [measure_case(case, threads, rounds[case.phase], say) for case in cases]
    return {
        "title": "RoPE alone, onnxruntime CPU",
        "runtime": f"onnxruntime CPUExecutionProvider, intra-op threads {threads}; torch eager and copy: "
                   f"torch.set_num_threads({threads})",
        "models": "issue 4's rope_export.bench.passes.variants(source, dtype, head_dim): transformers' "
                  "rotate-half with cos/sin gathered from a table by position_ids (source 'table') or computed "
                  "from inv_freq in the graph as transformers exports it (source 'computed'), exported by torch.onnx "
                  "(TorchScript, opset 17), then rope_export.passes.fuse + lower",
        "bytes_definition": "read x + the cos/sin rows used (rd/2 per token and table) + write the output, q and k",
        "ratios": "speedup_vs_decomposed = median(baseline) / median(runner); fraction_of_copy = "
                  "median(faster copy of the same bytes) / median(runner) (1.0 = as fast as a copy)",
        "ort_threads": "intra-op threads do not spin-wait between runs (session.intra_op.allow_spinning=0), so "
                       "the sessions and torch's pool interleaved on the same cores do not steal each other's time",
        "cases": results,
    }
