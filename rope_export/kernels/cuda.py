"""The rotary kernels on a GPU without TensorRT: a ctypes binding of librope_export_cuda.so and
PyTorch's CUDA implementation of ``rope_export::rotary_embedding``.

librope_export_cuda.so exports the CPU twin's C ABI (``RopeTwinArgs``, see plugins/cuda/rope_cuda_api.h)
plus a stream, and runs the very kernels of the TensorRT plugin (plugins/rotary/rotary_cuda.cu).
Work is enqueued on PyTorch's current stream of the tensors' device (CUDA graphs capture it), so
calls order with the surrounding PyTorch work like any PyTorch op. ``rotary_embedding_qk`` rotates
q and k in one launch when they share a kernel (same dtypes and path), as FlashInfer and vLLM do.

``register_torch_kernel`` makes eager PyTorch on a GPU run these kernels for the custom op (the CPU
keeps the reference). Without the library it warns once and falls back to the reference.
Only torch and ctypes are imported: no polygraphy, rich or TensorRT (scripts/gpu_check.sh runs
this on a bare GPU machine).
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from dataclasses import dataclass

import torch

from rope_export.kernels.cpu_twin import C_API_VERSION, TwinPlan, _TwinArgs, _TwinPlan, make_args, to_plan, twin
from rope_export.kernels.libraries import CUDA_LIBRARY, library_path
from rope_export.op import reference
from rope_export.op.contract import RotaryContractError

_ERR_LEN = 1024
_p = ctypes.POINTER


class _Device(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * 256), ("major", ctypes.c_int32), ("minor", ctypes.c_int32),
        ("multiprocessors", ctypes.c_int32), ("memory_clock_khz", ctypes.c_int64),
        ("memory_bus_width_bits", ctypes.c_int32),
    ]  # fmt: skip


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    capability: tuple[int, int]
    multiprocessors: int
    memory_clock_khz: int
    memory_bus_width_bits: int

    @property
    def peak_bandwidth(self) -> float | None:
        """Theoretical DRAM bandwidth in bytes/s: 2 (double data rate) x memory clock x bus width."""
        if not self.memory_clock_khz or not self.memory_bus_width_bits:
            return None
        return 2 * self.memory_clock_khz * 1e3 * self.memory_bus_width_bits / 8


@functools.cache
def library() -> ctypes.CDLL:
    """librope_export_cuda.so, loaded (PluginNotBuiltError if it is not built)."""
    lib = ctypes.CDLL(str(library_path(CUDA_LIBRARY)))
    sigs = {
        "rope_cuda_api_version": ([], ctypes.c_int32),
        "rope_cuda_built_archs": ([], ctypes.c_char_p),
        "rope_cuda_device_check": ([ctypes.c_char_p, ctypes.c_int64], ctypes.c_int32),
        "rope_cuda_device_info": ([_p(_Device), ctypes.c_char_p, ctypes.c_int64], ctypes.c_int32),
        "rope_cuda_run": ([_p(_TwinArgs), _p(_TwinPlan), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64],
                          ctypes.c_int32),
        "rope_cuda_run_pair": ([_p(_TwinArgs), _p(_TwinArgs), _p(_TwinPlan), _p(ctypes.c_int32), ctypes.c_void_p,
                                ctypes.c_char_p, ctypes.c_int64], ctypes.c_int32),
    }
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    if lib.rope_cuda_api_version() != C_API_VERSION:
        raise RuntimeError(f"{CUDA_LIBRARY} has C API version {lib.rope_cuda_api_version()}, this package expects "
                           f"{C_API_VERSION}; rebuild it with `make plugin` or `rope-export build-plugin`")
    return lib


def built_archs() -> tuple[int, ...]:
    """The SM architectures the kernels were compiled for (the newest also as PTX)."""
    return tuple(int(a) for a in library().rope_cuda_built_archs().decode().split(",") if a)


def device_check() -> str | None:
    """None when the current CUDA device can run the kernels, else the reason (device and build flag named)."""
    err = ctypes.create_string_buffer(_ERR_LEN)
    return err.value.decode() if library().rope_cuda_device_check(err, _ERR_LEN) else None


def device_info() -> DeviceInfo:
    out, err = _Device(), ctypes.create_string_buffer(_ERR_LEN)
    if library().rope_cuda_device_info(ctypes.byref(out), err, _ERR_LEN):
        raise RuntimeError(err.value.decode())
    return DeviceInfo(out.name.decode(), (out.major, out.minor), out.multiprocessors, out.memory_clock_khz,
                      out.memory_bus_width_bits)


def unavailable_reason() -> str | None:
    """One line saying why the kernels cannot run on a GPU here, or None when they can."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build (no CUDA)"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    try:
        library()
    except (OSError, RuntimeError) as exc:
        return str(exc)
    with torch.cuda.device(torch.cuda.current_device()):
        return device_check()


def no_kernel_image_message(device: str, capability: tuple[int, int], archs: tuple[int, ...]) -> str:
    """The kernels' refusal for a GPU a build has no code for (core/device_support.cpp, via the CPU twin)."""
    lib = twin()
    fn = lib.rope_no_kernel_image_message
    fn.argtypes = [ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int64]
    fn.restype = ctypes.c_int32
    out = ctypes.create_string_buffer(_ERR_LEN)
    fn(device.encode(), capability[0], capability[1], ",".join(map(str, archs)).encode(), out, _ERR_LEN)
    return out.value.decode()


# --- calls ------------------------------------------------------------------------------------------


def _prepared(x, cos_cache, sin_cache, position_ids, out):
    tensors = [x, cos_cache, sin_cache] + ([position_ids] if position_ids is not None else [])
    device = x.device
    for t in tensors:
        if t.device.type != "cuda" or t.device != device:
            raise ValueError(f"the CUDA kernels take CUDA tensors on one device, got {t.device} beside {device}; "
                             "CPU tensors run on the CPU twin: rope_export.kernels.cpu_twin.run")
    # Contiguous views keep their address (misaligned or not): the kernels choose their path from it.
    x, cos_cache, sin_cache = (t.contiguous() for t in (x, cos_cache, sin_cache))
    position_ids = position_ids.contiguous() if position_ids is not None else None
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out must be a contiguous tensor of shape {list(x.shape)}, dtype {x.dtype} on {device}")
    return x, cos_cache, sin_cache, position_ids, out


def _stream(device: torch.device, stream: torch.cuda.Stream | None) -> int:
    return (stream or torch.cuda.current_stream(device)).cuda_stream


def rotary_embedding(x, cos_cache, sin_cache, position_ids=None, *, interleaved=False, num_heads=0,
                     rotary_embedding_dim=0, force_scalar=False, out=None,
                     stream=None) -> tuple[torch.Tensor, TwinPlan]:
    """The op on the GPU, enqueued on ``stream`` (default: PyTorch's current one); (output, launch plan)."""
    x, cos_cache, sin_cache, position_ids, out = _prepared(x, cos_cache, sin_cache, position_ids, out)
    args = make_args(x, cos_cache, sin_cache, position_ids, out, interleaved=interleaved, num_heads=num_heads,
                     rotary_embedding_dim=rotary_embedding_dim, force_scalar=force_scalar)
    plan, err = _TwinPlan(), ctypes.create_string_buffer(_ERR_LEN)
    with torch.cuda.device(x.device):
        if library().rope_cuda_run(ctypes.byref(args), ctypes.byref(plan), _stream(x.device, stream), err, _ERR_LEN):
            raise RotaryContractError(err.value.decode())
    return out, to_plan(plan)


def rotary_embedding_qk(q, k, cos_cache, sin_cache, position_ids=None, *, interleaved=False, q_heads=0, k_heads=0,
                        rotary_embedding_dim=0, force_scalar=False, q_out=None, k_out=None, stream=None):
    """q and k in one launch when they share a kernel (else two): (q_out, k_out, fused).

    ``q_heads``/``k_heads``: num_heads of each when they are 3-D ``[B, S, H*D]``.
    """
    q, cos_cache, sin_cache, position_ids, q_out = _prepared(q, cos_cache, sin_cache, position_ids, q_out)
    k, _, _, _, k_out = _prepared(k, cos_cache, sin_cache, position_ids, k_out)
    common = dict(interleaved=interleaved, rotary_embedding_dim=rotary_embedding_dim, force_scalar=force_scalar)
    qa = make_args(q, cos_cache, sin_cache, position_ids, q_out, num_heads=q_heads, **common)
    ka = make_args(k, cos_cache, sin_cache, position_ids, k_out, num_heads=k_heads, **common)
    plans, fused, err = (_TwinPlan * 2)(), ctypes.c_int32(0), ctypes.create_string_buffer(_ERR_LEN)
    with torch.cuda.device(q.device):
        if library().rope_cuda_run_pair(ctypes.byref(qa), ctypes.byref(ka), plans, ctypes.byref(fused),
                                        _stream(q.device, stream), err, _ERR_LEN):
            raise RotaryContractError(err.value.decode())
    return q_out, k_out, bool(fused.value)


class BoundLaunch:
    """One call's arguments built once, launched many times on the current stream (benchmarks, CUDA
    graphs): the Python cost per launch is one ctypes call. The tensors must stay alive and in place."""

    def __init__(self, q, cos_cache, sin_cache, position_ids, q_out, k=None, k_out=None, *, interleaved=False,
                 q_heads=0, k_heads=0, rotary_embedding_dim=0):
        common = dict(interleaved=interleaved, rotary_embedding_dim=rotary_embedding_dim)
        for t in (q, cos_cache, sin_cache, position_ids, q_out, k, k_out):
            if t is not None and (t.device.type != "cuda" or not t.is_contiguous()):
                raise ValueError("BoundLaunch takes contiguous CUDA tensors")
        self.device = q.device
        self._keep = (q, cos_cache, sin_cache, position_ids, q_out, k, k_out)
        self._q = make_args(q, cos_cache, sin_cache, position_ids, q_out, num_heads=q_heads, **common)
        self._k = None if k is None else make_args(k, cos_cache, sin_cache, position_ids, k_out, num_heads=k_heads,
                                                   **common)
        self._err = ctypes.create_string_buffer(_ERR_LEN)
        self._fused = ctypes.c_int32(0)
        lib = library()
        self._run, self._pair = lib.rope_cuda_run, lib.rope_cuda_run_pair

    def __call__(self) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if self._k is None:
            rc = self._run(ctypes.byref(self._q), None, stream, self._err, _ERR_LEN)
        else:
            rc = self._pair(ctypes.byref(self._q), ctypes.byref(self._k), None, ctypes.byref(self._fused), stream,
                            self._err, _ERR_LEN)
        if rc:
            raise RotaryContractError(self._err.value.decode())

    @property
    def fused(self) -> bool:
        """Whether the last q+k call was one launch."""
        return bool(self._fused.value)


# --- PyTorch's CUDA implementation of the custom op ---------------------------------------------------


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"rope_export::rotary_embedding on CUDA runs the PyTorch reference, not the plugin's kernels: "
                  f"{reason}", RuntimeWarning, stacklevel=3)


def _torch_cuda_kernel(x, cos_cache, sin_cache, position_ids=None, interleaved=False, num_heads=0,
                       rotary_embedding_dim=0):
    try:
        library()
    except OSError as exc:  # PluginNotBuiltError: build it, meanwhile the reference
        _warn_fallback(str(exc))
        return reference.rotary_embedding(x, cos_cache, sin_cache, position_ids, interleaved=interleaved,
                                          num_heads=num_heads, rotary_embedding_dim=rotary_embedding_dim)
    out, _ = rotary_embedding(x, cos_cache, sin_cache, position_ids, interleaved=interleaved, num_heads=num_heads,
                              rotary_embedding_dim=rotary_embedding_dim)
    return out


def register_torch_kernel(op) -> None:
    """Register the kernels as ``op``'s CUDA implementation (a torch.library.custom_op)."""
    op.register_kernel("cuda")(_torch_cuda_kernel)
