// librope_export_cuda.so: the twin's C ABI run by the CUDA kernels (rotary/rotary_cuda.cu).
#include "rope_cuda_api.h"

#include "../rotary/rotary_cuda.h"
#include "../twin/rope_args.h"

#include <algorithm>
#include <cstring>
#include <string>

using rope::report;

namespace
{

// Arguments -> problem, refusing what only the twin supports and devices without a kernel image.
bool prepare(RopeTwinArgs const* a, rope::Problem& p, std::string& err)
{
    if (a == nullptr)
    {
        err = "no arguments";
        return false;
    }
    if (a->block_begin != 0 || a->block_end >= 0)
    {
        err = "block ranges (block_begin/block_end) are a CPU-twin feature; pass 0 and -1";
        return false;
    }
    return rope::problem_from_args(*a, p, err) && rope::device_supported(err);
}

int32_t launched(cudaError_t rc, char* err, int64_t err_len)
{
    if (rc == cudaSuccess)
    {
        return 0;
    }
    std::string msg;
    if (!rope::device_supported(msg))
    {
        return report(msg, err, err_len);
    }
    return report(std::string("kernel launch failed: ") + cudaGetErrorString(rc), err, err_len);
}

} // namespace

extern "C" {

int32_t rope_cuda_api_version(void)
{
    return ROPE_C_API_VERSION;
}

char const* rope_cuda_built_archs(void)
{
    return rope::built_archs();
}

int32_t rope_cuda_device_check(char* err, int64_t err_len)
{
    std::string msg;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1)
    {
        cudaGetLastError();
        return report("no CUDA device is visible", err, err_len);
    }
    return rope::device_supported(msg) ? 0 : report(msg, err, err_len);
}

int32_t rope_cuda_device_info(RopeCudaDevice* out, char* err, int64_t err_len)
{
    int device = 0;
    cudaDeviceProp prop{};
    int clock = 0;
    int width = 0;
    cudaError_t rc = cudaGetDevice(&device);
    if (rc == cudaSuccess)
    {
        rc = cudaGetDeviceProperties(&prop, device);
    }
    if (rc == cudaSuccess)
    {
        rc = cudaDeviceGetAttribute(&clock, cudaDevAttrMemoryClockRate, device);
    }
    if (rc == cudaSuccess)
    {
        rc = cudaDeviceGetAttribute(&width, cudaDevAttrGlobalMemoryBusWidth, device);
    }
    if (rc != cudaSuccess || out == nullptr)
    {
        cudaGetLastError();
        return report(out == nullptr ? "no output struct" : std::string("CUDA: ") + cudaGetErrorString(rc), err,
            err_len);
    }
    *out = RopeCudaDevice{};
    std::memcpy(out->name, prop.name, std::min(sizeof out->name, sizeof prop.name));
    out->name[sizeof out->name - 1] = '\0';
    out->major = prop.major;
    out->minor = prop.minor;
    out->multiprocessors = prop.multiProcessorCount;
    out->memory_clock_khz = clock;
    out->memory_bus_width_bits = width;
    return 0;
}

int32_t rope_cuda_run(RopeTwinArgs const* a, RopeTwinPlan* plan, void* stream, char* err, int64_t err_len)
{
    rope::Problem p{};
    std::string msg;
    if (!prepare(a, p, msg))
    {
        return report(msg, err, err_len);
    }
    if (plan != nullptr)
    {
        *plan = rope::plan_to_c(rope::make_plan(p, a->force_scalar != 0));
    }
    return launched(rope::launch_cuda(p, a->force_scalar != 0, static_cast<cudaStream_t>(stream)), err, err_len);
}

int32_t rope_cuda_run_pair(RopeTwinArgs const* a, RopeTwinArgs const* b, RopeTwinPlan* plans, int32_t* fused,
    void* stream, char* err, int64_t err_len)
{
    rope::Problem pa{};
    rope::Problem pb{};
    std::string msg;
    if (!prepare(a, pa, msg) || !prepare(b, pb, msg))
    {
        return report(msg, err, err_len);
    }
    bool const force_scalar = a->force_scalar != 0 || b->force_scalar != 0;
    if (plans != nullptr)
    {
        plans[0] = rope::plan_to_c(rope::make_plan(pa, force_scalar));
        plans[1] = rope::plan_to_c(rope::make_plan(pb, force_scalar));
    }
    bool one = false;
    cudaError_t const rc = rope::launch_cuda_pair(pa, pb, force_scalar, static_cast<cudaStream_t>(stream), &one);
    if (fused != nullptr)
    {
        *fused = one ? 1 : 0;
    }
    return launched(rc, err, err_len);
}

} // extern "C"
