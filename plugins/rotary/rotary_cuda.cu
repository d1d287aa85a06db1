// CUDA kernels: each thread runs the shared per-thread body (rotary_kernel.cuh) at its grid index.
#include "rotary_cuda.h"

#include "../core/device_support.h"

#include <atomic>

#ifdef ROPE_EXPORT_HAVE_ARCH_HEADER
#include "rope_cuda_archs.h" // written by cmake/nvcc_ptxas_check.cmake: the -gencode list
#else
#define ROPE_EXPORT_CUDA_ARCH_LIST ""
#endif

namespace rope
{

// One launch runs up to two problems: blocks [0, a.grid_x) rotate a, the next b.grid_x blocks b
// (grid_x = 0: no second problem). At least 4 resident blocks per SM (<= 64 registers): with the
// bare block size, ptxas aimed at full occupancy (32 registers) and spilled the scalar fp32 kernel.
template <class K>
__global__ void __launch_bounds__(kBlockThreads, 4) rotary_kernel(Problem pa, Plan la, Problem pb, Plan lb)
{
    Idx2 const thread{threadIdx.x, threadIdx.y};
    int64_t const bx = blockIdx.x;
    if (bx < la.grid_x)
    {
        if (blockIdx.y < static_cast<unsigned>(la.grid_y))
        {
            K::run_thread(pa, la, Idx2{bx, blockIdx.y}, thread);
        }
    }
    else if (blockIdx.y < static_cast<unsigned>(lb.grid_y))
    {
        K::run_thread(pb, lb, Idx2{bx - la.grid_x, blockIdx.y}, thread);
    }
}

namespace
{

bool empty(Problem const& p, Plan const& l)
{
    return l.tokens == 0 || p.heads == 0 || p.head_dim == 0;
}

// Same instantiation and block shape: the pair can share one launch.
bool same_kernel(Problem const& a, Plan const& la, Problem const& b, Plan const& lb)
{
    return a.x_type == b.x_type && a.cache_type == b.cache_type && a.interleaved == b.interleaved
        && la.vectorized == lb.vectorized && la.block_x == lb.block_x && la.block_y == lb.block_y;
}

cudaError_t launch(Problem const& pa, Plan la, Problem const& pb, Plan lb, cudaStream_t stream)
{
    // Each half keeps at most 2^30 blocks along x (its grid-stride loop covers the rest).
    constexpr int64_t kHalfGridX = int64_t{1} << 30;
    la.grid_x = la.grid_x < kHalfGridX ? la.grid_x : kHalfGridX;
    lb.grid_x = lb.grid_x < kHalfGridX ? lb.grid_x : kHalfGridX;
    int32_t const grid_y = la.grid_y > lb.grid_y ? la.grid_y : lb.grid_y;
    dim3 const grid(static_cast<unsigned>(la.grid_x + lb.grid_x), static_cast<unsigned>(grid_y));
    dim3 const block(static_cast<unsigned>(la.block_x), static_cast<unsigned>(la.block_y));
    bool const ok = dispatch(
        pa, la, [&](auto kernel) { rotary_kernel<decltype(kernel)><<<grid, block, 0, stream>>>(pa, la, pb, lb); });
    return ok ? cudaGetLastError() : cudaErrorInvalidValue;
}

} // namespace

cudaError_t launch_cuda(Problem const& p, bool force_scalar, cudaStream_t stream)
{
    Plan const l = make_plan(p, force_scalar);
    if (empty(p, l))
    {
        return cudaSuccess;
    }
    if (misaligned_tensor(p) != nullptr)
    {
        return cudaErrorMisalignedAddress; // every access assumes element alignment
    }
    Plan none = l;
    none.grid_x = 0;
    return launch(p, l, p, none, stream);
}

cudaError_t launch_cuda_pair(Problem const& a, Problem const& b, bool force_scalar, cudaStream_t stream, bool* fused)
{
    Plan const la = make_plan(a, force_scalar);
    Plan const lb = make_plan(b, force_scalar);
    if ((!empty(a, la) && misaligned_tensor(a) != nullptr) || (!empty(b, lb) && misaligned_tensor(b) != nullptr))
    {
        return cudaErrorMisalignedAddress; // every access assumes element alignment
    }
    bool const one = !empty(a, la) && !empty(b, lb) && same_kernel(a, la, b, lb);
    if (fused != nullptr)
    {
        *fused = one;
    }
    if (one)
    {
        return launch(a, la, b, lb, stream);
    }
    cudaError_t const rc = launch_cuda(a, force_scalar, stream);
    return rc != cudaSuccess ? rc : launch_cuda(b, force_scalar, stream);
}

char const* built_archs()
{
    return ROPE_EXPORT_CUDA_ARCH_LIST;
}

bool device_supported(std::string& err)
{
    constexpr int kMaxDevices = 64;
    static std::atomic<int> known[kMaxDevices] = {}; // 0: not checked yet, 1: supported
    int count = 0;
    int device = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1 || cudaGetDevice(&device) != cudaSuccess)
    {
        cudaGetLastError(); // no driver or no device: nothing to refuse here; a launch reports it
        return true;
    }
    if (device >= 0 && device < kMaxDevices && known[device].load() == 1)
    {
        return true;
    }
    cudaFuncAttributes attrs{};
    cudaError_t const rc = cudaFuncGetAttributes(&attrs, rotary_kernel<Kernel<float, float, false, false>>);
    if (rc == cudaSuccess)
    {
        if (device >= 0 && device < kMaxDevices)
        {
            known[device].store(1);
        }
        return true;
    }
    cudaGetLastError();
    cudaDeviceProp prop{};
    bool const named = cudaGetDeviceProperties(&prop, device) == cudaSuccess;
    if (rc == cudaErrorNoKernelImageForDevice || rc == cudaErrorInvalidDeviceFunction)
    {
        err = no_kernel_image_message(named ? prop.name : "CUDA device " + std::to_string(device),
            named ? prop.major : 0, named ? prop.minor : 0, built_archs());
    }
    else
    {
        err = std::string("CUDA cannot load the rope_export kernels on device ") + std::to_string(device) + ": "
            + cudaGetErrorString(rc);
    }
    return false;
}

} // namespace rope
