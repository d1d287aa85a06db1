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

std::string fmt(Dims const& d)
{
    std::string s = "[";
    for (int32_t i = 0; i < d.rank; ++i)
    {
        s += (i ? ", " : "") + std::to_string(d.d[i]);
    }
    return s + "]";
}

// The buffer behind a tensor holds what its shape says, checked in 64-bit arithmetic that cannot wrap.
bool fits(std::string& err, char const* what, Dims const& d, int64_t elem_bytes, int64_t have, char const* field)
{
    int64_t need = elem_bytes;
    for (int32_t i = 0; i < d.rank; ++i)
    {
        if (d.d[i] < 0 || __builtin_mul_overflow(need, d.d[i], &need))
        {
            return fail(err, std::string(what) + " " + fmt(d) + " has more bytes than a 64-bit size holds");
        }
    }
    if (have < need)
    {
        return fail(err, std::string(what) + " " + fmt(d) + " needs " + std::to_string(need)
                + " bytes but its buffer holds " + std::to_string(have) + " (RopeTwinArgs." + field
                + "); pass shapes that match the buffers");
    }
    return true;
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
    if (elems > 0) // an empty X reads nothing
    {
        Dims const xd = to_dims(a.x_shape, a.x_rank);
        int64_t const xb = type_size(x_type);
        int64_t const cb = type_size(cache_type);
        if (!fits(err, "X", xd, xb, a.x_bytes, "x_bytes")
            || !fits(err, "cos_cache", to_dims(a.cos_shape, a.cos_rank), cb, a.cos_bytes, "cos_bytes")
            || !fits(err, "sin_cache", to_dims(a.sin_shape, a.sin_rank), cb, a.sin_bytes, "sin_bytes")
            || (has_pos
                && !fits(err, "position_ids", pd, int64_t{sizeof(int64_t)}, a.position_ids_bytes,
                    "position_ids_bytes"))
            || !fits(err, "the output", xd, xb, a.out_bytes, "out_bytes"))
        {
            return false;
        }
    }
    return true;
}

RopeTwinPlan plan_to_c(Plan const& l)
{
    return RopeTwinPlan{l.vectorized ? 1 : 0, l.pairs_per_unit, l.tail_elems, l.rot_units, l.units, l.block_x,
        l.block_y, l.grid_y, l.grid_x, l.tokens};
}

} // namespace rope
