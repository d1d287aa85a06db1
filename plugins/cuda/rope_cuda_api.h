/* C ABI of the CUDA library (librope_export_cuda.so): the CPU twin's call (twin/rope_c_api.h) run by
 * the CUDA kernels on a stream. rope_export/cuda.py calls it with ctypes and registers it as
 * PyTorch's CUDA implementation of rope_export::rotary_embedding.
 *
 * Tensors are device pointers (X, caches, positions, out); the call only enqueues work on `stream`
 * (a cudaStream_t; NULL: the legacy default stream) and returns. Every function returns 0 on
 * success, else non-zero with a one-line message in err. */
#ifndef ROPE_EXPORT_CUDA_API_H
#define ROPE_EXPORT_CUDA_API_H

#include "../twin/rope_c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct RopeCudaDevice
{
    char name[256];
    int32_t major, minor, multiprocessors;
    int64_t memory_clock_khz; /* peak memory clock */
    int32_t memory_bus_width_bits;
} RopeCudaDevice;

ROPE_API int32_t rope_cuda_api_version(void);

/* The SM architectures the kernels were built for, "75,80,...": the newest also as PTX. */
ROPE_API const char* rope_cuda_built_archs(void);

/* 0 when the current device can run the kernels; else the reason (device and build flag named). */
ROPE_API int32_t rope_cuda_device_check(char* err, int64_t err_len);

ROPE_API int32_t rope_cuda_device_info(RopeCudaDevice* out, char* err, int64_t err_len);

/* One tensor. block_begin/block_end must be 0/-1 (block ranges are the twin's test feature). */
ROPE_API int32_t rope_cuda_run(const RopeTwinArgs* args, RopeTwinPlan* plan, void* stream, char* err, int64_t err_len);

/* Two tensors (q and k) in one launch when they share a kernel (dtypes, layout, path, block shape),
 * else two launches; *fused says which. plans: 2 entries, or NULL. */
ROPE_API int32_t rope_cuda_run_pair(const RopeTwinArgs* a, const RopeTwinArgs* b, RopeTwinPlan* plans,
    int32_t* fused, void* stream, char* err, int64_t err_len);

#ifdef __cplusplus
}
#endif

#endif /* ROPE_EXPORT_CUDA_API_H */
