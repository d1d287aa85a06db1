"""The CUDA library and its binding where no GPU is needed (these run everywhere, CI included):
it loads without a driver (static CUDA runtime), names what it was built for, refuses what it
cannot run with a message, and is PyTorch's CUDA implementation of the custom op. The kernels
themselves run in tests/kernels/test_gpu_kernels.py (marker gpu)."""

from __future__ import annotations

import subprocess
import warnings

import pytest
import torch

from rope_export.kernels import cuda
from rope_export.kernels.libraries import CUDA_ARCHS, CUDA_LIBRARY, PluginNotBuiltError, plugin_dir
from rope_export.op import reference
from rope_export.runtimes.trt import _cuda_device_problem

BUILT = (plugin_dir() / CUDA_LIBRARY).is_file()
needs_library = pytest.mark.skipif(not BUILT, reason=f"{CUDA_LIBRARY} is not built here (nvcc not found)")
NO_DEVICE = _cuda_device_problem()  # asks the driver itself: torch may be a CPU build


@needs_library
def test_library_loads_and_names_its_architectures():
    assert cuda.built_archs() == CUDA_ARCHS
    if NO_DEVICE:
        assert cuda.device_check() == "no CUDA device is visible"
        with pytest.raises(RuntimeError, match="CUDA"):
            cuda.device_info()


def test_refusal_names_the_device_and_the_build_flag():
    message = cuda.no_kernel_image_message("NVIDIA Thor", (11, 0), (80, 90))
    assert message == (
        "the rope_export kernels were not built for NVIDIA Thor (sm_110): this build has sm_80, sm_90 and PTX of "
        'compute_90; rebuild with `rope-export build-plugin --cuda-archs "80,90,110"` '
        '(CMake: -DROPE_EXPORT_CUDA_ARCHS="...;110")')


def test_unavailable_reason_is_one_line():
    reason = cuda.unavailable_reason()
    if reason is None:
        pytest.skip("the kernels can run here")
    assert reason and "\n" not in reason


@needs_library
def test_cpu_tensors_are_refused_with_the_fix():
    x = torch.randn(1, 2, 3, 8)
    refusal = "the CUDA kernels take CUDA tensors .* CPU twin: rope_export.kernels.cpu_twin.run"
    with pytest.raises(ValueError, match=refusal):
        cuda.rotary_embedding(x, torch.ones(3, 4), torch.ones(3, 4))


def test_the_custom_op_has_a_cuda_kernel_and_the_cpu_keeps_the_reference():
    import rope_export.kernels.torch_op  # noqa: F401 - defines the op and registers the CUDA kernel

    assert torch._C._dispatch_has_kernel_for_dispatch_key("rope_export::rotary_embedding", "CUDA")
    x, cos = torch.randn(1, 2, 3, 8), torch.randn(5, 4)
    pos = torch.tensor([[0, 4, 9]])
    assert torch.equal(torch.ops.rope_export.rotary_embedding(x, cos, cos, pos),
                       reference.rotary_embedding(x, cos, cos, pos))


def test_without_the_library_the_cuda_kernel_warns_once_and_uses_the_reference(monkeypatch):
    def missing():
        raise PluginNotBuiltError(f"{CUDA_LIBRARY} not found in build/plugins; build it with `make plugin`")

    monkeypatch.setattr(cuda, "library", missing)
    cuda._warn_fallback.cache_clear()
    x, cos = torch.randn(1, 2, 3, 8), torch.randn(1, 3, 4)  # per-token caches, no positions
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = cuda._torch_cuda_kernel(x, cos, cos)  # the registered kernel's body, on CPU tensors
        cuda._torch_cuda_kernel(x, cos, cos)
    assert torch.equal(out, reference.rotary_embedding(x, cos, cos))
    assert [str(w.message) for w in seen] == [
        "rope_export::rotary_embedding on CUDA runs the PyTorch reference, not the plugin's kernels: "
        f"{CUDA_LIBRARY} not found in build/plugins; build it with `make plugin`"]


@needs_library
def test_sanitizer_sweep_says_it_needs_a_gpu_here():
    if not NO_DEVICE:
        pytest.skip("a GPU is present: tests/kernels/test_gpu_kernels.py runs the sweep under compute-sanitizer")
    proc = subprocess.run([str(plugin_dir() / "rope_export_cuda_sanitize")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 77
    assert proc.stderr.strip() == "rope_export_cuda_sanitize: no CUDA device; the sweep needs a GPU"
