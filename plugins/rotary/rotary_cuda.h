// The GPU launchers of the rotary kernels (rotary_cuda.cu, compiled by nvcc).
#pragma once

#include "rotary_kernel.cuh"

#include <cuda_runtime_api.h>

#include <string>

namespace rope
{

// Launches the kernel for p on stream. Returns cudaSuccess, or the launch error. Nothing is
// launched for an empty problem, nor (cudaErrorMisalignedAddress) when a pointer is not aligned
// to its element (see misaligned_tensor). force_scalar: skip the vector path (tests, benchmarks).
cudaError_t launch_cuda(Problem const& p, bool force_scalar, cudaStream_t stream);

// Rotates two tensors that share a kernel instantiation (dtypes, pair layout, vector or scalar path,
// block shape) in one launch, e.g. q and k of one attention layer; otherwise launches twice.
// *fused (may be null) tells which happened.
cudaError_t launch_cuda_pair(Problem const& a, Problem const& b, bool force_scalar, cudaStream_t stream, bool* fused);

// Whether this build has a kernel image for the current device. Returns false with a message naming
// the device and the build flag when it has none, or when CUDA reports another error. With no CUDA
// device at all there is nothing to run on and nothing to refuse: true.
bool device_supported(std::string& err);

// The SM architectures the kernels were compiled for ("75,80,..."), the newest also as PTX.
char const* built_archs();

} // namespace rope
