// CUDA kernels: each thread runs the shared per-thread body (rotary_kernel.cuh) at its grid index.
#include "rotary_cuda.h"

namespace rope
{

// At least 4 resident blocks per SM (<= 64 registers): with the bare block size, ptxas aimed at full
// occupancy (32 registers) and spilled the scalar fp32 kernel on sm_80.
template <class K>
__global__ void __launch_bounds__(kBlockThreads, 4) rotary_kernel(Problem p, Plan l)
{
    K::run_thread(p, l, Idx2{blockIdx.x, blockIdx.y}, Idx2{threadIdx.x, threadIdx.y});
}

cudaError_t launch_cuda(Problem const& p, bool force_scalar, cudaStream_t stream)
{
    Plan const l = make_plan(p, force_scalar);
    if (l.tokens == 0 || p.heads == 0 || p.head_dim == 0)
    {
        return cudaSuccess;
    }
    if (misaligned_tensor(p) != nullptr)
    {
        return cudaErrorMisalignedAddress; // every access assumes element alignment
    }
    dim3 const grid(static_cast<unsigned>(l.grid_x), static_cast<unsigned>(l.grid_y));
    dim3 const block(static_cast<unsigned>(l.block_x), static_cast<unsigned>(l.block_y));
    bool const ok = dispatch(p, l, [&](auto kernel) { rotary_kernel<decltype(kernel)><<<grid, block, 0, stream>>>(p, l); });
    return ok ? cudaGetLastError() : cudaErrorInvalidValue;
}

} // namespace rope
