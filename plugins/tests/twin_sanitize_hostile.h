// The sanitizer driver's hostile cases (issue 16): every C ABI pointer null in turn, tensors not
// aligned to their elements, values the field serializer cannot hold. Included once, by
// twin_sanitize_driver.cpp, which runs them under ASan + UBSan.
#pragma once

#include "../twin/rope_c_api.h"
#include "twin_sanitize_common.h"

#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace
{

// Values an INT32 field cannot hold, or that parsing would refuse, are refused, never narrowed.
void serializer_cases()
{
    char err[512];
    RopeField sf[3];
    int32_t sv[3];
    int64_t const big = int64_t{1} << 32;
    int64_t const refused[][3] = {{0, big + 8, 0}, {0, 0, big + 64}, {0, -1, 0}, {0, 8, 7}, {2, 8, 0},
        {0, std::numeric_limits<int64_t>::min(), 0}, {0, int64_t{2147483647} + 1, 0}};
    for (auto const& v : refused)
    {
        std::memset(sv, 0x55, sizeof sv);
        check_rejects(("serializing (" + std::to_string(v[0]) + ", " + std::to_string(v[1]) + ", "
                          + std::to_string(v[2]) + ")")
                          .c_str(),
            rope_serialize_fields(v[0], v[1], v[2], sf, sv, err, sizeof err), err);
        if (sv[0] != 0 || sv[1] != 0 || sv[2] != 0)
        {
            fail("a refused serialization left values behind");
        }
    }
    ++g_cases;
    if (rope_serialize_fields(0, 2147483647, 0, sf, sv, err, sizeof err) != 0 || sv[1] != 2147483647)
    {
        fail("num_heads = 2^31 - 1 should serialize");
    }
}

// Every pointer of the C ABI, null in turn: refused with a message (or "no"), never dereferenced.
void null_pointer_cases()
{
    char err[512];
    auto fresh = [&err]() { // a stale message must not pass for this call's
        err[0] = '\0';
        return err;
    };
    int const refused_before = g_refused;
    RopeGeometry g;
    int64_t const x[] = {1, 2, 3, 8};
    int64_t const cs[] = {5, 4};
    int64_t const pos[] = {1, 3};
    check_rejects("a null X shape",
        rope_resolve_shape(nullptr, 4, cs, 2, cs, 2, pos, 2, 0, 0, 0, &g, fresh(), sizeof err), err);
    check_rejects("a null cos shape",
        rope_resolve_shape(x, 4, nullptr, 2, cs, 2, pos, 2, 0, 0, 0, &g, fresh(), sizeof err), err);
    check_rejects("a null sin shape",
        rope_resolve_shape(x, 4, cs, 2, nullptr, 2, pos, 2, 0, 0, 0, &g, fresh(), sizeof err), err);
    check_rejects("a null position_ids shape",
        rope_resolve_shape(x, 4, cs, 2, cs, 2, nullptr, 2, 0, 0, 0, &g, fresh(), sizeof err), err);
    ++g_cases;
    if (rope_resolve_shape(x, 4, cs, 2, cs, 2, pos, 2, 0, 0, 0, nullptr, nullptr, 0) != 0)
    {
        fail("a valid shape with no geometry or error buffer was refused");
    }
    if (rope_resolve_shape(nullptr, 4, cs, 2, cs, 2, pos, 2, 0, 0, 0, nullptr, nullptr, 0) == 0)
    {
        fail("a null X shape with no error buffer was accepted");
    }
    int32_t const one = 1;
    RopeField const f[] = {{"num_heads", &one, 5, 1}};
    check_rejects("a null attribute array", rope_parse_fields(f, 1, 0, nullptr, fresh(), sizeof err), err);
    RopeField sf[3];
    int32_t sv[3];
    check_rejects("null serialized fields", rope_serialize_fields(0, 1, 0, nullptr, sv, fresh(), sizeof err), err);
    check_rejects("null serialized values", rope_serialize_fields(0, 1, 0, sf, nullptr, fresh(), sizeof err), err);
    check_rejects("null dtype names in check_dtypes", rope_check_dtypes(nullptr, nullptr, nullptr, fresh(), sizeof err), err);
    ++g_cases;
    if (rope_metadata_string(0, 1, 0, nullptr, 64) == 0)
    {
        fail("metadata_string wrote to a null buffer");
    }
    if (rope_supports_combination(0, nullptr, nullptr, 3, 1) != 0)
    {
        fail("supports_combination answered yes for null arrays");
    }
    char const* names[] = {"float32", "float32", "float32"};
    check_rejects("a null output dtype buffer", rope_output_dtype(names, 3, 1, nullptr, 0, fresh(), sizeof err), err);
    check_rejects("a null input dtype array", rope_output_dtype(nullptr, 3, 1, nullptr, 0, fresh(), sizeof err), err);
    check_rejects("null twin arguments", rope_twin_run(nullptr, nullptr, fresh(), sizeof err), err);

    // rope_twin_run with each tensor pointer null in turn (and its dtype name null).
    std::vector<float> xs(1 * 2 * 3 * 8, 1.0f);
    std::vector<float> outs(xs.size(), 0.0f);
    std::vector<float> cache(5 * 4, 0.5f);
    std::vector<int64_t> ps = {0, 1, 9};
    auto args = [&]() {
        RopeTwinArgs a{};
        a.x = xs.data();
        a.cos_cache = a.sin_cache = cache.data();
        a.position_ids = ps.data();
        a.out = outs.data();
        a.x_dtype = a.cos_dtype = a.sin_dtype = "float32";
        a.position_ids_dtype = "int64";
        std::memcpy(a.x_shape, x, sizeof x);
        a.x_rank = 4;
        std::memcpy(a.cos_shape, cs, sizeof cs);
        std::memcpy(a.sin_shape, cs, sizeof cs);
        a.cos_rank = a.sin_rank = 2;
        std::memcpy(a.position_ids_shape, pos, sizeof pos);
        a.position_ids_rank = 2;
        a.block_end = -1;
        a.x_bytes = a.out_bytes = static_cast<int64_t>(xs.size() * sizeof(float));
        a.cos_bytes = a.sin_bytes = static_cast<int64_t>(cache.size() * sizeof(float));
        a.position_ids_bytes = static_cast<int64_t>(ps.size() * sizeof(int64_t));
        return a;
    };
    ++g_cases;
    RopeTwinArgs ok = args();
    if (rope_twin_run(&ok, nullptr, nullptr, 0) != 0)
    {
        fail("a valid twin run with no plan or error buffer failed");
    }
    for (int k = 0; k < 9; ++k)
    {
        RopeTwinArgs a = args();
        char const* what[] = {"null X", "null cos_cache", "null sin_cache", "null position_ids", "null output",
            "a null X dtype", "a null cache dtype", "a null position_ids dtype", "null everything"};
        switch (k)
        {
        case 0: a.x = nullptr; break;
        case 1: a.cos_cache = nullptr; break;
        case 2: a.sin_cache = nullptr; break;
        case 3: a.position_ids = nullptr; break;
        case 4: a.out = nullptr; break;
        case 5: a.x_dtype = nullptr; break;
        case 6: a.cos_dtype = a.sin_dtype = nullptr; break;
        case 7: a.position_ids_dtype = nullptr; break;
        default:
            a.x = a.cos_cache = a.sin_cache = nullptr;
            a.position_ids = nullptr;
            a.out = nullptr;
            a.x_dtype = a.cos_dtype = a.sin_dtype = a.position_ids_dtype = nullptr;
        }
        check_rejects(what[k], rope_twin_run(&a, nullptr, fresh(), sizeof err), err);
    }
    g_refused_null = g_refused - refused_before;
}

// A pointer that is not aligned to its element size (a byte offset of 1, 2 or 4) is refused with
// a message naming the tensor, before anything is read or written; the output stays untouched.
template <class T, class C>
void element_misaligned_cases()
{
    int64_t const b = 1, s = 3, h = 2, d = 16, max_pos = 5, half = d / 2;
    size_t const nx = static_cast<size_t>(b * h * s * d);
    for (int which = 0; which < 5; ++which) // X, cos, sin, position_ids, out
    {
        size_t const elem = which == 3 ? sizeof(int64_t) : (which == 1 || which == 2) ? sizeof(C) : sizeof(T);
        for (size_t off = 1; off < elem; off *= 2)
        {
            Buffer x(nx * sizeof(T), which == 0 ? off : 0);
            Buffer cosb(static_cast<size_t>(max_pos * half) * sizeof(C), which == 1 ? off : 0);
            Buffer sinb(static_cast<size_t>(max_pos * half) * sizeof(C), which == 2 ? off : 0);
            Buffer pos(static_cast<size_t>(b * s) * sizeof(int64_t), which == 3 ? off : 0);
            Buffer out(nx * sizeof(T), which == 4 ? off : 0);
            std::memset(x.data, 0, x.bytes);
            std::memset(cosb.data, 0, cosb.bytes);
            std::memset(sinb.data, 0, sinb.bytes);
            std::memset(pos.data, 0, pos.bytes);
            std::memset(out.data, 0xAB, out.bytes);
            RopeTwinArgs a{};
            a.x = x.data;
            a.cos_cache = cosb.data;
            a.sin_cache = sinb.data;
            a.position_ids = reinterpret_cast<int64_t const*>(pos.data); // never dereferenced here
            a.out = out.data;
            a.x_dtype = name_of<T>();
            a.cos_dtype = a.sin_dtype = name_of<C>();
            a.position_ids_dtype = "int64";
            int64_t const xshape[] = {b, h, s, d};
            std::memcpy(a.x_shape, xshape, sizeof xshape);
            a.x_rank = 4;
            a.cos_shape[0] = a.sin_shape[0] = max_pos;
            a.cos_shape[1] = a.sin_shape[1] = half;
            a.cos_rank = a.sin_rank = 2;
            a.position_ids_shape[0] = b;
            a.position_ids_shape[1] = s;
            a.position_ids_rank = 2;
            a.block_end = -1;
            a.x_bytes = static_cast<int64_t>(x.bytes);
            a.cos_bytes = static_cast<int64_t>(cosb.bytes);
            a.sin_bytes = static_cast<int64_t>(sinb.bytes);
            a.position_ids_bytes = static_cast<int64_t>(pos.bytes);
            a.out_bytes = static_cast<int64_t>(out.bytes);
            char err[512] = {};
            std::string const label = std::string("tensor #") + std::to_string(which) + " at byte offset "
                + std::to_string(off) + " (" + name_of<T>() + "/" + name_of<C>() + ")";
            int const refused_before = g_refused;
            check_rejects(label.c_str(), rope_twin_run(&a, nullptr, err, sizeof err), err);
            g_refused_misaligned += g_refused - refused_before;
            char const* names[] = {"X", "cos_cache", "sin_cache", "position_ids", "the output"};
            if (std::strncmp(err, names[which], std::strlen(names[which])) != 0)
            {
                fail(label + ": the message does not name the tensor: " + err);
            }
            for (size_t i = 0; i < out.bytes; ++i)
            {
                if (out.data[i] != 0xAB)
                {
                    fail(label + ": the output was written");
                    break;
                }
            }
        }
    }
}

// Counts and sizes past the memory the caller gave: refused before any access. A field count of 1e9
// over a one-field array, and shapes that overstate a buffer, even with a grid block range of one
// block (before the fix both read past the arrays: a segfault).
void size_cases()
{
    char err[512];
    int64_t attrs[3];
    int const refused_before = g_refused;
    int32_t const one = 1;
    RopeField const f[] = {{"num_heads", &one, 5, 1}};
    for (int32_t count : {1000000000, 17, 2147483647})
    {
        check_rejects(("a field count of " + std::to_string(count)).c_str(),
            rope_parse_fields(f, count, 0, attrs, err, sizeof err), err);
    }
    std::vector<float> xs(64, 1.0f);
    std::vector<float> outs(64, 0.0f);
    std::vector<float> cache(64, 0.5f);
    std::vector<int64_t> ps(64, 0);
    auto args = [&](int64_t h, int64_t d, int64_t rows) {
        RopeTwinArgs a{};
        a.x = xs.data();
        a.cos_cache = a.sin_cache = cache.data();
        a.position_ids = ps.data();
        a.out = outs.data();
        a.x_dtype = a.cos_dtype = a.sin_dtype = "float32";
        a.position_ids_dtype = "int64";
        int64_t const x[] = {1, h, 1, d};
        std::memcpy(a.x_shape, x, sizeof x);
        a.x_rank = 4;
        a.cos_shape[0] = a.sin_shape[0] = rows;
        a.cos_shape[1] = a.sin_shape[1] = d / 2;
        a.cos_rank = a.sin_rank = 2;
        a.position_ids_shape[0] = a.position_ids_shape[1] = 1;
        a.position_ids_rank = 2;
        a.block_begin = 0;
        a.block_end = 1; // one block: the first token only
        a.x_bytes = a.out_bytes = static_cast<int64_t>(xs.size() * sizeof(float));
        a.cos_bytes = a.sin_bytes = static_cast<int64_t>(cache.size() * sizeof(float));
        a.position_ids_bytes = static_cast<int64_t>(ps.size() * sizeof(int64_t));
        return a;
    };
    RopeTwinArgs huge = args(int64_t{1} << 20, int64_t{1} << 20, 4);
    check_rejects("X [1, 2^20, 1, 2^20] over 64 floats, one block", rope_twin_run(&huge, nullptr, err, sizeof err), err);
    RopeTwinArgs rows = args(2, 8, int64_t{1} << 40);
    check_rejects("caches of 2^40 rows over 64 floats", rope_twin_run(&rows, nullptr, err, sizeof err), err);
    for (int k = 0; k < 5; ++k) // each buffer one byte short of its shape, in turn
    {
        RopeTwinArgs a = args(2, 8, 4);
        int64_t* sizes[] = {&a.x_bytes, &a.cos_bytes, &a.sin_bytes, &a.position_ids_bytes, &a.out_bytes};
        int64_t const need[] = {16 * 4, 16 * 4, 16 * 4, 8, 16 * 4};
        *sizes[k] = need[k] - 1;
        check_rejects(("buffer #" + std::to_string(k) + " one byte short").c_str(),
            rope_twin_run(&a, nullptr, err, sizeof err), err);
    }
    ++g_cases;
    RopeTwinArgs exact = args(2, 8, 4);
    exact.x_bytes = exact.out_bytes = exact.cos_bytes = exact.sin_bytes = 16 * 4;
    exact.position_ids_bytes = 8;
    if (rope_twin_run(&exact, nullptr, err, sizeof err) != 0)
    {
        fail(std::string("buffers of exactly their shapes' size were refused: ") + err);
    }
    g_refused_sizes = g_refused - refused_before;
}

} // namespace
