// Host-side glue between the TensorRT-free core (resolved geometry, dtype names) and the kernels'
// Problem; shared by the CPU twin and the TensorRT plugin's enqueue.
#pragma once

#include "../core/rope_core.h"
#include "rotary_kernel.cuh"

#include <string>

namespace rope
{

inline bool storage_type(std::string const& name, StorageType& out)
{
    if (name == "float32")
    {
        out = StorageType::kFloat32;
    }
    else if (name == "float16")
    {
        out = StorageType::kFloat16;
    }
    else if (name == "bfloat16")
    {
        out = StorageType::kBFloat16;
    }
    else
    {
        return false;
    }
    return true;
}

inline Problem make_problem(Geometry const& g, bool interleaved, StorageType x_type, StorageType cache_type,
    void const* x, void const* cos_cache, void const* sin_cache, int64_t const* position_ids, void* out)
{
    Problem p{};
    p.x = x;
    p.cos_cache = cos_cache;
    p.sin_cache = sin_cache;
    p.position_ids = g.max_pos >= 0 ? position_ids : nullptr;
    p.out = out;
    p.x_type = x_type;
    p.cache_type = cache_type;
    p.batch = g.batch;
    p.seq = g.seq;
    p.heads = g.heads;
    p.head_dim = g.head_dim;
    p.rotary_dim = g.rotary_dim;
    p.max_pos = g.max_pos;
    p.layout_bhsd = g.layout_bhsd;
    p.interleaved = interleaved;
    return p;
}

} // namespace rope
