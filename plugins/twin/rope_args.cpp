#include "rope_args.h"

#include <algorithm>
#include <cstring>

namespace rope
{
Dims to_dims(int64_t const* d, int32_t rank)
{
    Dims out;
    out.rank = rank;
    for (int32_t i = 0; i < rank && i < kMaxRank; ++i)
    {
        out.d[i] = d[i];
    }
    return out;
}

bool bad_rank(int32_t rank)
{
    return rank < 0 || rank > kMaxRank;
}

int32_t report(std::string const& msg, char* err, int64_t err_len)
{
    if (err != nullptr && err_len > 0)
    {
        size_t const n = std::min(msg.size(), static_cast<size_t>(err_len - 1));
        std::memcpy(err, msg.data(), n);
        err[n] = '\0';
    }
    return 1;
}

namespace
{

bool fail(std::string& err, std::string msg)
{
    err = std::move(msg);
    return false;
}

} // namespace

bool problem_from_args(RopeTwinArgs const& a, Problem& out, std::string& err)
{
    bool const has_pos = a.position_ids_rank >= 0;
    if (bad_rank(a.x_rank) || bad_rank(a.cos_rank) || bad_rank(a.sin_rank) || a.position_ids_rank > kMaxRank)
    {
        return fail(err, "tensor ranks must be in [0, 8]");
    }
    Dims const pd = has_pos ? to_dims(a.position_ids_shape, a.position_ids_rank) : Dims{};
    Attrs const attrs{a.interleaved, a.num_heads, a.rotary_embedding_dim};
    Geometry g;
    // Same order as rope_export.reference.rotary_embedding: shapes, then cos/sin dtypes, then dtypes.
    if (!resolve_shape(to_dims(a.x_shape, a.x_rank), to_dims(a.cos_shape, a.cos_rank),
            to_dims(a.sin_shape, a.sin_rank), has_pos ? &pd : nullptr, attrs, g, err))
    {
        return false;
    }
    if (a.interleaved != 0 && a.interleaved != 1)
    {
        return fail(err, "interleaved must be 0 or 1, got " + std::to_string(a.interleaved));
    }
    std::string const xt = a.x_dtype ? a.x_dtype : "";
    std::string const ct = a.cos_dtype ? a.cos_dtype : "";
    std::string const st = a.sin_dtype ? a.sin_dtype : "";
    std::string const pt = a.position_ids_dtype ? a.position_ids_dtype : "";
    if (ct != st)
    {
        return fail(err, "cos_cache (" + ct + ") and sin_cache (" + st + ") must have the same dtype");
    }
    if (!check_dtypes(xt, ct, has_pos ? &pt : nullptr, err))
    {
        return false;
    }
    StorageType x_type{};
    StorageType cache_type{};
    storage_type(xt, x_type);
    storage_type(ct, cache_type);
    int64_t const elems = g.batch * g.seq * g.heads * g.head_dim;
    if (elems > 0
        && (a.x == nullptr || a.out == nullptr || a.cos_cache == nullptr || a.sin_cache == nullptr
            || (has_pos && a.position_ids == nullptr)))
    {
        return fail(err, "a tensor pointer is null");
    }
    out = make_problem(
        g, a.interleaved != 0, x_type, cache_type, a.x, a.cos_cache, a.sin_cache, a.position_ids, a.out);
    int32_t element_bytes = 0;
    if (char const* bad = misaligned_tensor(out, &element_bytes); bad != nullptr && elems > 0)
    {
        return fail(err, std::string(bad) + "'s data pointer is not aligned to its " + std::to_string(element_bytes)
                + "-byte elements; the kernels (and a GPU) need element-aligned tensors: pass an aligned copy");
    }
    return true;
}

RopeTwinPlan plan_to_c(Plan const& l)
{
    return RopeTwinPlan{l.vectorized ? 1 : 0, l.pairs_per_unit, l.tail_elems, l.rot_units, l.units, l.block_x,
        l.block_y, l.grid_y, l.grid_x, l.tokens};
}

} // namespace rope
