/* C ABI of the CPU twin library (librope_export_twin.so), called from Python with ctypes
 * (rope_export/plugin.py mirrors these structs; keep both in step).
 *
 * Every function returns 0 on success. On failure it returns non-zero and writes a one-line,
 * NUL-terminated message into err (truncated to err_len bytes; err may be NULL). Dtypes are
 * torch/numpy names. Every pointer argument is checked: a NULL where data is needed is an error
 * (or "not supported" for rope_supports_combination), never a dereference. Tensor pointers of
 * rope_twin_run must be aligned to their element size (a GPU faults otherwise); the vector path is
 * taken only where every pointer it touches is aligned to its access width. */
#ifndef ROPE_EXPORT_C_API_H
#define ROPE_EXPORT_C_API_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ROPE_API __attribute__((visibility("default")))

enum
{
    ROPE_C_API_VERSION = 3 /* 2: rope_serialize_fields reports errors; 3: RopeTwinArgs carries buffer sizes */
};

typedef struct RopeGeometry
{
    int64_t batch, seq, heads, head_dim, rotary_dim;
    int64_t max_pos; /* -1 without position_ids */
    int32_t layout_bhsd;
} RopeGeometry;

/* Same layout intent as nvinfer1::PluginField; type codes are nvinfer1::PluginFieldType's. */
typedef struct RopeField
{
    const char* name;
    const void* data;
    int32_t type;
    int32_t length;
} RopeField;

typedef struct RopeTwinArgs
{
    const void* x;
    const void* cos_cache;
    const void* sin_cache;
    const int64_t* position_ids; /* NULL: per-token caches */
    void* out;                   /* a separate buffer of X's shape and dtype */
    const char* x_dtype;
    const char* cos_dtype;
    const char* sin_dtype;
    const char* position_ids_dtype; /* ignored when position_ids is NULL */
    int64_t x_shape[8];
    int64_t cos_shape[8];
    int64_t sin_shape[8];
    int64_t position_ids_shape[8];
    int32_t x_rank, cos_rank, sin_rank, position_ids_rank;
    int64_t interleaved, num_heads, rotary_embedding_dim;
    int32_t force_scalar; /* 1: take the scalar path even where the vector path could run */
    /* Run only grid blocks [block_begin, block_end) along x (tokens); block_end < 0: all. Lets a
       test run the last blocks of a grid too large to run whole. */
    int64_t block_begin, block_end;
    /* Bytes each buffer holds from its pointer on (API 3). A call whose shapes need more (for a
       non-empty X) is refused before any access: a shape that overstates its buffer, or sizes a
       64-bit byte count cannot hold, must not make the grid, or a block range of it, read past it. */
    int64_t x_bytes, cos_bytes, sin_bytes, position_ids_bytes, out_bytes;
} RopeTwinArgs;

typedef struct RopeTwinPlan
{
    int32_t vectorized;
    int32_t pairs_per_unit, tail_elems, rot_units, units;
    int32_t block_x, block_y, grid_y;
    int64_t grid_x, tokens;
} RopeTwinPlan;

ROPE_API int32_t rope_c_api_version(void);
ROPE_API const char* rope_plugin_name(void);
ROPE_API const char* rope_plugin_version(void);
ROPE_API const char* rope_plugin_namespace(void);

/* rope_export.contract.resolve_shape; position_ids_rank < 0: no position_ids. */
ROPE_API int32_t rope_resolve_shape(const int64_t* x, int32_t x_rank, const int64_t* cos, int32_t cos_rank,
    const int64_t* sin, int32_t sin_rank, const int64_t* position_ids, int32_t position_ids_rank,
    int64_t interleaved, int64_t num_heads, int64_t rotary_embedding_dim, RopeGeometry* out, char* err,
    int64_t err_len);

/* The rank-only part of the shape rules (what the plugin checks before sizes are known). */
ROPE_API int32_t rope_check_ranks(int32_t x_rank, int32_t cos_rank, int32_t sin_rank, int32_t position_ids_rank,
    int64_t num_heads, int64_t rotary_embedding_dim, char* err, int64_t err_len);

/* rope_export.contract.check_dtypes; position_ids_dtype NULL: no position_ids. */
ROPE_API int32_t rope_check_dtypes(
    const char* x_dtype, const char* cache_dtype, const char* position_ids_dtype, char* err, int64_t err_len);

/* Plugin field parsing; phase 0 = build, 1 = runtime (deserialization). out: the 3 attributes. */
ROPE_API int32_t rope_parse_fields(
    const RopeField* fields, int32_t count, int32_t phase, int64_t out[3], char* err, int64_t err_len);

/* The fields the plugin serializes; their data points into values. Refuses (never narrows) values
   that rope_parse_fields would refuse. */
ROPE_API int32_t rope_serialize_fields(int64_t interleaved, int64_t num_heads, int64_t rotary_embedding_dim,
    RopeField fields[3], int32_t values[3], char* err, int64_t err_len);

ROPE_API int32_t rope_metadata_string(
    int64_t interleaved, int64_t num_heads, int64_t rotary_embedding_dim, char* out, int64_t out_len);

/* supportsFormatCombination (returns 1 when supported, else 0) and getOutputDataTypes. */
ROPE_API int32_t rope_supports_combination(
    int32_t pos, const char* const* dtypes, const int32_t* linear, int32_t nb_inputs, int32_t nb_outputs);
ROPE_API int32_t rope_output_dtype(const char* const* input_dtypes, int32_t nb_inputs, int32_t nb_outputs,
    char* out, int64_t out_len, char* err, int64_t err_len);

/* Runs the kernels' code on the CPU over the same grid as the GPU launch. plan may be NULL. */
ROPE_API int32_t rope_twin_run(const RopeTwinArgs* args, RopeTwinPlan* plan, char* err, int64_t err_len);

/* The message the kernels give for a GPU this build has no kernel image for (core/device_support.h);
 * built_archs like "75,80,90". Returns non-zero if out is too small. */
ROPE_API int32_t rope_no_kernel_image_message(const char* device_name, int32_t major, int32_t minor,
    const char* built_archs, char* out, int64_t out_len);

#ifdef __cplusplus
}
#endif

#endif /* ROPE_EXPORT_C_API_H */
