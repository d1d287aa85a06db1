// The GPU launcher of the rotary kernels (rotary_cuda.cu, compiled by nvcc).
#pragma once

#include "rotary_kernel.cuh"

#include <cuda_runtime_api.h>

namespace rope
{

// Launches the kernel for p on stream. Returns cudaSuccess, or the launch error. Nothing is
// launched for an empty problem, nor (cudaErrorMisalignedAddress) when a pointer is not aligned
// to its element (see misaligned_tensor). force_scalar: skip the vector path (tests, benchmarks).
cudaError_t launch_cuda(Problem const& p, bool force_scalar, cudaStream_t stream);

} // namespace rope
