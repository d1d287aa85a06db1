// The CPU twin: the kernels' per-thread code (rotary/rotary_kernel.cuh) driven by a host loop over
// the same grid the CUDA launcher uses, plus the C ABI over the TensorRT-free core.
#include "rope_c_api.h"

#include "../core/rope_core.h"
#include "../rotary/rotary_problem.h"
#include "rope_args.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

using rope::report;

namespace
{

// A shape array is needed as soon as its rank is positive.
bool missing_dims(int64_t const* d, int32_t rank)
{
    return rank > 0 && d == nullptr;
}

int32_t copy_out(std::string const& s, char* out, int64_t out_len)
{
    if (out == nullptr || out_len <= static_cast<int64_t>(s.size()))
    {
        return 1;
    }
    std::memcpy(out, s.c_str(), s.size() + 1);
    return 0;
}

// The host loop: every (block, thread) of the launch, in order. Threads of a block never touch the
// same output element, so the order does not matter.
template <class K>
void run_grid(rope::Problem const& p, rope::Plan const& l, int64_t block_begin, int64_t block_end)
{
    for (int64_t bx = block_begin; bx < block_end; ++bx)
    {
        for (int64_t by = 0; by < l.grid_y; ++by)
        {
            for (int64_t ty = 0; ty < l.block_y; ++ty)
            {
                for (int64_t tx = 0; tx < l.block_x; ++tx)
                {
                    K::run_thread(p, l, rope::Idx2{bx, by}, rope::Idx2{tx, ty});
                }
            }
        }
    }
}

} // namespace

extern "C" {

int32_t rope_c_api_version(void)
{
    return ROPE_C_API_VERSION;
}

char const* rope_plugin_name(void)
{
    return rope::kPluginName;
}

char const* rope_plugin_version(void)
{
    return rope::kPluginVersion;
}

char const* rope_plugin_namespace(void)
{
    return rope::kPluginNamespace;
}

int32_t rope_resolve_shape(int64_t const* x, int32_t x_rank, int64_t const* cos, int32_t cos_rank, int64_t const* sin,
    int32_t sin_rank, int64_t const* position_ids, int32_t position_ids_rank, int64_t interleaved, int64_t num_heads,
    int64_t rotary_embedding_dim, RopeGeometry* out, char* err, int64_t err_len)
{
    if (rope::bad_rank(x_rank) || rope::bad_rank(cos_rank) || rope::bad_rank(sin_rank) || position_ids_rank > rope::kMaxRank)
    {
        return report("tensor ranks must be in [0, 8]", err, err_len);
    }
    if (missing_dims(x, x_rank) || missing_dims(cos, cos_rank) || missing_dims(sin, sin_rank)
        || missing_dims(position_ids, position_ids_rank))
    {
        return report("a shape pointer is null while its rank is positive", err, err_len);
    }
    rope::Dims const xd = rope::to_dims(x, x_rank);
    rope::Dims const cd = rope::to_dims(cos, cos_rank);
    rope::Dims const sd = rope::to_dims(sin, sin_rank);
    rope::Dims const pd = position_ids_rank >= 0 ? rope::to_dims(position_ids, position_ids_rank) : rope::Dims{};
    rope::Attrs const attrs{interleaved, num_heads, rotary_embedding_dim};
    rope::Geometry g;
    std::string msg;
    if (!rope::resolve_shape(xd, cd, sd, position_ids_rank >= 0 ? &pd : nullptr, attrs, g, msg))
    {
        return report(msg, err, err_len);
    }
    if (out != nullptr)
    {
        *out = RopeGeometry{g.batch, g.seq, g.heads, g.head_dim, g.rotary_dim, g.max_pos, g.layout_bhsd ? 1 : 0};
    }
    return 0;
}

int32_t rope_check_ranks(int32_t x_rank, int32_t cos_rank, int32_t sin_rank, int32_t position_ids_rank,
    int64_t num_heads, int64_t rotary_embedding_dim, char* err, int64_t err_len)
{
    std::string msg;
    if (!rope::check_ranks(x_rank, cos_rank, sin_rank, position_ids_rank, rope::Attrs{0, num_heads, rotary_embedding_dim},
            msg))
    {
        return report(msg, err, err_len);
    }
    return 0;
}

int32_t rope_check_dtypes(
    char const* x_dtype, char const* cache_dtype, char const* position_ids_dtype, char* err, int64_t err_len)
{
    std::string const pos = position_ids_dtype ? position_ids_dtype : "";
    std::string msg;
    if (!rope::check_dtypes(x_dtype ? x_dtype : "", cache_dtype ? cache_dtype : "",
            position_ids_dtype ? &pos : nullptr, msg))
    {
        return report(msg, err, err_len);
    }
    return 0;
}

int32_t rope_parse_fields(
    RopeField const* fields, int32_t count, int32_t phase, int64_t out[3], char* err, int64_t err_len)
{
    if (phase != 0 && phase != 1)
    {
        return report("phase must be 0 (build) or 1 (runtime)", err, err_len);
    }
    if (out == nullptr)
    {
        return report("no output array for the 3 attributes", err, err_len);
    }
    std::string msg;
    if (!rope::check_field_count(fields, count, msg)) // before the copy: a wrong count must not size it
    {
        return report(msg, err, err_len);
    }
    // RopeField and rope::Field have the same members; copy rather than pun.
    std::vector<rope::Field> fs;
    if (fields != nullptr && count > 0)
    {
        fs.reserve(static_cast<size_t>(count));
        for (int32_t i = 0; i < count; ++i)
        {
            fs.push_back(
                rope::Field{fields[i].name, fields[i].data, static_cast<rope::FieldType>(fields[i].type), fields[i].length});
        }
    }
    rope::Attrs attrs;
    if (!rope::parse_fields(fields == nullptr ? nullptr : fs.data(), count, static_cast<rope::Phase>(phase), attrs, msg))
    {
        return report(msg, err, err_len);
    }
    out[0] = attrs.interleaved;
    out[1] = attrs.num_heads;
    out[2] = attrs.rotary_embedding_dim;
    return 0;
}

int32_t rope_serialize_fields(int64_t interleaved, int64_t num_heads, int64_t rotary_embedding_dim,
    RopeField fields[3], int32_t values[3], char* err, int64_t err_len)
{
    if (fields == nullptr || values == nullptr)
    {
        return report("no output arrays for the fields and their values", err, err_len);
    }
    rope::Attrs const attrs{interleaved, num_heads, rotary_embedding_dim};
    int32_t vals[rope::kNumFields];
    rope::Field fs[rope::kNumFields];
    std::string msg;
    bool const ok = rope::serialize_fields(attrs, vals, fs, msg); // all zero when refused
    for (int32_t k = 0; k < rope::kNumFields; ++k)
    {
        values[k] = vals[k];
        fields[k] = RopeField{fs[k].name, &values[k], static_cast<int32_t>(fs[k].type), fs[k].length};
    }
    return ok ? 0 : report(msg, err, err_len);
}

int32_t rope_metadata_string(
    int64_t interleaved, int64_t num_heads, int64_t rotary_embedding_dim, char* out, int64_t out_len)
{
    return copy_out(rope::metadata_string(rope::Attrs{interleaved, num_heads, rotary_embedding_dim}), out, out_len);
}

int32_t rope_supports_combination(
    int32_t pos, char const* const* dtypes, int32_t const* linear, int32_t nb_inputs, int32_t nb_outputs)
{
    std::string msg;
    // Counts first: the arrays hold nb_inputs + nb_outputs entries only when the counts are valid.
    if (dtypes == nullptr || linear == nullptr || !rope::check_io_counts(nb_inputs, nb_outputs, msg))
    {
        return 0;
    }
    bool lin[8] = {};
    for (int32_t i = 0; i < nb_inputs + nb_outputs; ++i)
    {
        lin[i] = linear[i] != 0;
    }
    return rope::supports_combination(pos, dtypes, lin, nb_inputs, nb_outputs) ? 1 : 0;
}

int32_t rope_output_dtype(char const* const* input_dtypes, int32_t nb_inputs, int32_t nb_outputs, char* out,
    int64_t out_len, char* err, int64_t err_len)
{
    std::string dtype;
    std::string msg;
    if (!rope::output_dtype(input_dtypes, nb_inputs, nb_outputs, dtype, msg))
    {
        return report(msg, err, err_len);
    }
    if (copy_out(dtype, out, out_len) != 0)
    {
        return report("output buffer too small", err, err_len);
    }
    return 0;
}

int32_t rope_twin_run(RopeTwinArgs const* a, RopeTwinPlan* plan_out, char* err, int64_t err_len)
{
    if (a == nullptr)
    {
        return report("no arguments", err, err_len);
    }
    rope::Problem p{};
    std::string msg;
    if (!rope::problem_from_args(*a, p, msg))
    {
        return report(msg, err, err_len);
    }
    int64_t const elems = p.batch * p.seq * p.heads * p.head_dim;
    rope::Plan const l = rope::make_plan(p, a->force_scalar != 0);
    if (plan_out != nullptr)
    {
        *plan_out = rope::plan_to_c(l);
    }
    int64_t const begin = std::max<int64_t>(a->block_begin, 0);
    int64_t const end = a->block_end < 0 ? l.grid_x : std::min(a->block_end, l.grid_x);
    if (elems == 0 || begin >= end)
    {
        return 0;
    }
    bool const ok = rope::dispatch(p, l, [&](auto kernel) { run_grid<decltype(kernel)>(p, l, begin, end); });
    return ok ? 0 : report("unsupported dtype combination", err, err_len);
}

} // extern "C"
