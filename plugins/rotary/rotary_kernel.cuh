// The rotary op (rope_export/contract.py) as per-thread code shared by the CUDA kernels and the
// CPU twin: the problem description, the launch plan (grid, block, vector or scalar path), the body
// one thread runs, and the dtype/variant dispatch. Everything here is __host__ __device__; the GPU
// launcher (rotary_cuda.cu) and the host loop (twin/rope_twin.cpp) are thin drivers around it.
//
// Work split: a "token" is one (b, s). Its cos/sin row is shared by all heads, so a thread takes
// one chunk of rotary pairs (a "unit"), loads that chunk of cos/sin once, and walks the heads.
// Units past the rotary pairs are chunks of the pass-through tail channels, copied to the output.
// All index math is int64: B*S*H*D may exceed 2^31.
#pragma once

#include "rotary_types.cuh"

namespace rope
{

enum class StorageType : int32_t
{
    kFloat32 = 0,
    kFloat16 = 1,
    kBFloat16 = 2,
};

// One rotary application, resolved (see core/rope_core.h resolve_shape) and ready to run.
struct Problem
{
    void const* x;
    void const* cos_cache;
    void const* sin_cache;
    int64_t const* position_ids; // [B, S] or null: caches are then per token [B, S, half]
    void* out;                   // same shape and layout as x, never aliasing the inputs
    StorageType x_type;
    StorageType cache_type; // x_type or kFloat32
    int64_t batch, seq, heads, head_dim, rotary_dim;
    int64_t max_pos;     // cache rows when position_ids are given
    bool layout_bhsd;    // 4-D [B, H, S, D]; else 3-D [B, S, H*D]
    bool interleaved;    // pairs (2i, 2i+1); else (i, i + rotary_dim/2)
};

// The grid both drivers walk. dim3-like, but int64 where the count can be large.
struct Plan
{
    bool vectorized;
    int32_t pairs_per_unit; // rotary pairs handled by one unit
    int32_t tail_elems;     // pass-through channels per tail unit
    int32_t rot_units, units;
    int32_t block_x, block_y; // threads: units x tokens
    int64_t tokens;
    int64_t grid_x; // blocks over tokens (grid-stride loop past it)
    int32_t grid_y; // head groups: >1 only when there are too few tokens to fill the GPU
};

constexpr int32_t kBlockThreads = 256;
constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kTargetBlocks = 1024; // about 8 resident blocks on each of ~132 SMs

// Vector width (elements of T in 16 bytes).
constexpr int32_t vec_elems(StorageType t)
{
    return t == StorageType::kFloat32 ? 4 : 8;
}
constexpr int32_t type_size(StorageType t)
{
    return t == StorageType::kFloat32 ? 4 : 2;
}

inline bool aligned(void const* p, int64_t bytes)
{
    return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

// Every access, scalar or vector, assumes each pointer aligned to its element (a GPU faults on a
// misaligned 2/4/8-byte access, the twin aborts). Returns the first tensor that is not, or null,
// and its element size in *element_bytes; drivers refuse such a problem (twin: an error,
// launch_cuda: cudaErrorMisalignedAddress). A null pointer counts as aligned (an empty problem
// never dereferences it; the twin checks nulls before).
inline char const* misaligned_tensor(Problem const& p, int32_t* element_bytes = nullptr)
{
    struct Entry
    {
        char const* name;
        void const* ptr;
        int32_t bytes;
    };
    Entry const entries[] = {{"X", p.x, type_size(p.x_type)}, {"cos_cache", p.cos_cache, type_size(p.cache_type)},
        {"sin_cache", p.sin_cache, type_size(p.cache_type)},
        {"position_ids", p.position_ids, static_cast<int32_t>(sizeof(int64_t))},
        {"the output", p.out, type_size(p.x_type)}};
    for (Entry const& e : entries)
    {
        if (!aligned(e.ptr, e.bytes))
        {
            if (element_bytes != nullptr)
            {
                *element_bytes = e.bytes;
            }
            return e.name;
        }
    }
    return nullptr;
}

// The vector path moves whole chunks in single accesses: X and the output in 16-byte chunks, the
// caches in chunks of `pairs` elements (16 bytes, or 8 for an interleaved fp32 cache row chunk).
// It needs every chunk boundary on such a boundary: the sizes must be whole chunks and every
// pointer involved aligned to the access width actually used; otherwise the plan is scalar.
// position_ids are read one int64 at a time on both paths (misaligned_tensor checks them).
inline bool can_vectorize(Problem const& p)
{
    int64_t const vec = vec_elems(p.x_type);
    int64_t const half = p.rotary_dim / 2;
    int64_t const pairs = p.interleaved ? vec / 2 : vec;
    if (p.head_dim == 0 || half == 0 || half % pairs != 0 || (p.head_dim - p.rotary_dim) % vec != 0)
    {
        return false;
    }
    int64_t const x_bytes = vec * type_size(p.x_type); // always 16
    if (!aligned(p.x, x_bytes) || !aligned(p.out, x_bytes))
    {
        return false;
    }
    int64_t const cache_bytes = pairs * type_size(p.cache_type);
    int64_t const cache_align = cache_bytes >= 16 ? 16 : cache_bytes; // Pack<C, pairs>'s alignment
    return aligned(p.cos_cache, cache_align) && aligned(p.sin_cache, cache_align);
}

inline Plan make_plan(Problem const& p, bool force_scalar)
{
    Plan l{};
    l.vectorized = !force_scalar && can_vectorize(p);
    int32_t const vec = l.vectorized ? vec_elems(p.x_type) : 1;
    l.pairs_per_unit = l.vectorized ? (p.interleaved ? vec / 2 : vec) : 1;
    l.tail_elems = vec;
    int64_t const half = p.rotary_dim / 2;
    int64_t const rot_units = half / l.pairs_per_unit;
    int64_t const units = rot_units + (p.head_dim - p.rotary_dim) / l.tail_elems;
    // head_dim fits int32 in every real model; resolve_shape rejects larger ones.
    l.rot_units = static_cast<int32_t>(rot_units);
    l.units = static_cast<int32_t>(units);
    l.block_x = units < kBlockThreads ? static_cast<int32_t>(units) : kBlockThreads;
    if (l.block_x < 1)
    {
        l.block_x = 1;
    }
    l.block_y = kBlockThreads / l.block_x;
    l.tokens = p.batch * p.seq;
    int64_t const token_blocks = (l.tokens + l.block_y - 1) / l.block_y;
    l.grid_x = token_blocks < kMaxGridX ? token_blocks : kMaxGridX;
    int64_t groups = 1;
    if (token_blocks > 0 && token_blocks < kTargetBlocks)
    {
        groups = (kTargetBlocks + token_blocks - 1) / token_blocks;
        groups = groups < p.heads ? groups : p.heads;
        groups = groups < 65535 ? groups : 65535;
        groups = groups > 1 ? groups : 1;
    }
    l.grid_y = static_cast<int32_t>(groups);
    return l;
}

struct Idx2
{
    int64_t x, y;
};

// What one thread (thread, in block) does. PAIRS rotary pairs per unit, TAIL channels per tail unit;
// VECTOR: each run of unit channels is one aligned access (else one access per element).
template <class T, class C, bool INTERLEAVED, int PAIRS, int TAIL, bool VECTOR>
ROPE_HD void rotary_thread(Problem const& p, Plan const& l, Idx2 block, Idx2 thread)
{
    T const* __restrict__ x = static_cast<T const*>(p.x);
    T* __restrict__ out = static_cast<T*>(p.out);
    C const* __restrict__ cosc = static_cast<C const*>(p.cos_cache);
    C const* __restrict__ sinc = static_cast<C const*>(p.sin_cache);
    int64_t const half = p.rotary_dim / 2;
    int64_t const stride_h = p.layout_bhsd ? p.seq * p.head_dim : p.head_dim;
    int64_t const stride_s = p.layout_bhsd ? p.head_dim : p.heads * p.head_dim;
    int64_t const stride_b = p.heads * p.seq * p.head_dim;
    int64_t const token_step = l.grid_x * l.block_y;

    for (int64_t tok = block.x * l.block_y + thread.y; tok < l.tokens; tok += token_step)
    {
        int64_t const b = tok / p.seq;
        int64_t const s = tok - b * p.seq;
        int64_t row = tok;
        bool pass = false;
        if (p.position_ids != nullptr)
        {
            row = p.position_ids[tok];
            pass = row < 0 || row >= p.max_pos; // the contract's pass-through: never read the cache
        }
        int64_t const base = b * stride_b + s * stride_s;

        for (int64_t u = thread.x; u < l.units; u += l.block_x)
        {
            if (u >= l.rot_units) // pass-through tail channels: copy
            {
                int64_t const c = p.rotary_dim + (u - l.rot_units) * TAIL;
                for (int64_t h = block.y; h < p.heads; h += l.grid_y)
                {
                    int64_t const o = base + h * stride_h + c;
                    store_pack<T, TAIL>(out + o, load_pack<T, TAIL>(x + o));
                }
                continue;
            }
            int64_t const i = u * PAIRS; // first pair of this unit
            // Pair k of the unit: channels (i+k, i+k+half) for rotate-half, (2(i+k), 2(i+k)+1) interleaved.
            constexpr int kWidth = INTERLEAVED ? 2 * PAIRS : PAIRS;
            constexpr int kAccess = VECTOR ? kWidth : 1;
            int64_t const c1 = INTERLEAVED ? 2 * i : i;
            if (pass)
            {
                for (int64_t h = block.y; h < p.heads; h += l.grid_y)
                {
                    int64_t const o = base + h * stride_h + c1;
                    store_elems<T, kWidth, kAccess>(out + o, load_elems<T, kWidth, kAccess>(x + o));
                    if (!INTERLEAVED)
                    {
                        store_elems<T, kWidth, kAccess>(out + o + half, load_elems<T, kWidth, kAccess>(x + o + half));
                    }
                }
                continue;
            }
            // Loaded once per token and unit, reused for every head this thread walks.
            Pack<C, PAIRS> const cp = load_pack<C, PAIRS>(cosc + row * half + i);
            Pack<C, PAIRS> const sp = load_pack<C, PAIRS>(sinc + row * half + i);
            float cf[PAIRS];
            float sf[PAIRS];
            ROPE_UNROLL
            for (int k = 0; k < PAIRS; ++k)
            {
                cf[k] = to_float(cp.v[k]);
                sf[k] = to_float(sp.v[k]);
            }
            for (int64_t h = block.y; h < p.heads; h += l.grid_y)
            {
                int64_t const o = base + h * stride_h + c1;
                if (INTERLEAVED)
                {
                    Pack<T, kWidth> const a = load_elems<T, kWidth, kAccess>(x + o);
                    Pack<T, kWidth> r;
                    ROPE_UNROLL
                    for (int k = 0; k < PAIRS; ++k)
                    {
                        float const x1 = to_float(a.v[2 * k]);
                        float const x2 = to_float(a.v[2 * k + 1]);
                        r.v[2 * k] = from_float<T>(x1 * cf[k] - x2 * sf[k]);
                        r.v[2 * k + 1] = from_float<T>(x1 * sf[k] + x2 * cf[k]);
                    }
                    store_elems<T, kWidth, kAccess>(out + o, r);
                }
                else
                {
                    Pack<T, kWidth> const a = load_elems<T, kWidth, kAccess>(x + o);
                    Pack<T, kWidth> const b2 = load_elems<T, kWidth, kAccess>(x + o + half);
                    Pack<T, kWidth> r1;
                    Pack<T, kWidth> r2;
                    ROPE_UNROLL
                    for (int k = 0; k < PAIRS; ++k)
                    {
                        float const x1 = to_float(a.v[k]);
                        float const x2 = to_float(b2.v[k]);
                        r1.v[k] = from_float<T>(x1 * cf[k] - x2 * sf[k]);
                        r2.v[k] = from_float<T>(x1 * sf[k] + x2 * cf[k]);
                    }
                    store_elems<T, kWidth, kAccess>(out + o, r1);
                    store_elems<T, kWidth, kAccess>(out + o + half, r2);
                }
            }
        }
    }
}

// A compile-time description of one kernel instantiation.
template <class T, class C, bool INTERLEAVED, bool VECTOR>
struct Kernel
{
    using X = T;
    using Cache = C;
    static constexpr bool kInterleaved = INTERLEAVED;
    static constexpr int kVec = 16 / static_cast<int>(sizeof(T));
    static constexpr int kPairs = VECTOR ? (INTERLEAVED ? kVec / 2 : kVec) : 1;
    static constexpr int kTail = VECTOR ? kVec : 1;

    ROPE_HD static void run_thread(Problem const& p, Plan const& l, Idx2 block, Idx2 thread)
    {
        rotary_thread<T, C, INTERLEAVED, kPairs, kTail, VECTOR>(p, l, block, thread);
    }
};

// Calls f(Kernel<...>{}) for the instantiation that fits (p, plan); returns false for a dtype
// combination the contract does not allow (checked earlier by check_dtypes; kept as a guard).
template <class F>
bool dispatch(Problem const& p, Plan const& l, F&& f)
{
    auto run = [&](auto xt, auto ct) {
        using T = decltype(xt);
        using C = decltype(ct);
        if (p.interleaved && l.vectorized)
        {
            f(Kernel<T, C, true, true>{});
        }
        else if (p.interleaved)
        {
            f(Kernel<T, C, true, false>{});
        }
        else if (l.vectorized)
        {
            f(Kernel<T, C, false, true>{});
        }
        else
        {
            f(Kernel<T, C, false, false>{});
        }
        return true;
    };
    bool const f32_cache = p.cache_type == StorageType::kFloat32;
    if (!f32_cache && p.cache_type != p.x_type)
    {
        return false;
    }
    switch (p.x_type)
    {
    case StorageType::kFloat32: return run(float{}, float{});
    case StorageType::kFloat16: return f32_cache ? run(f16{}, float{}) : run(f16{}, f16{});
    case StorageType::kBFloat16: return f32_cache ? run(bf16{}, float{}) : run(bf16{}, bf16{});
    }
    return false;
}

} // namespace rope
