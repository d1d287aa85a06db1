// Runs the CPU twin through its C ABI under AddressSanitizer + UBSan (built with
// -fsanitize=address,undefined; tests/kernels/test_plugin_twin.py runs it). Every buffer is allocated at
// exactly its size (misaligned ones end exactly at the end of their allocation too), so a read
// or write one element too far is reported. The outputs are checked against a plain loop that
// follows the op contract, independent of the kernels' grid and vector code. The hostile cases
// (null and misaligned pointers, field values out of range) are in twin_sanitize_hostile.h.
#include "../rotary/rotary_types.cuh"
#include "../twin/rope_c_api.h"
#include "twin_sanitize_common.h"
#include "twin_sanitize_hostile.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace
{

template <class T>
float tol_of();
template <>
float tol_of<float>()
{
    return 1e-5f;
}
template <>
float tol_of<rope::f16>()
{
    return 2e-3f;
}
template <>
float tol_of<rope::bf16>()
{
    return 1.6e-2f;
}

struct Case
{
    int64_t b, s, h, d, rd_attr; // rd_attr: the attribute (0 = whole head)
    bool bhsd, interleaved, with_pos, force_scalar;
    // 0: all aligned; shifted one element (element-aligned, not 16-byte aligned): 1 X and out,
    // 2 both caches, 3 X only, 4 the output only, 5 cos only, 6 sin only, 7 position_ids only.
    int misalign;
    int64_t max_pos;
};

template <class T, class C>
void run_case(Case const& c)
{
    ++g_cases;
    int64_t const rd = c.rd_attr ? c.rd_attr : c.d;
    int64_t const half = rd / 2;
    int64_t const n = c.b * c.s * c.h * c.d;
    int64_t const cache_rows = c.with_pos ? c.max_pos : c.b * c.s;
    auto shift = [&](std::initializer_list<int> when, size_t bytes) {
        for (int m : when)
        {
            if (c.misalign == m)
            {
                return bytes;
            }
        }
        return size_t{0};
    };
    Buffer x(static_cast<size_t>(n) * sizeof(T), shift({1, 3}, sizeof(T)));
    Buffer out(static_cast<size_t>(n) * sizeof(T), shift({1, 4}, sizeof(T)));
    Buffer cosb(static_cast<size_t>(cache_rows * half) * sizeof(C), shift({2, 5}, sizeof(C)));
    Buffer sinb(static_cast<size_t>(cache_rows * half) * sizeof(C), shift({2, 6}, sizeof(C)));
    Buffer pos(static_cast<size_t>(c.b * c.s) * sizeof(int64_t), shift({7}, sizeof(int64_t)));
    int64_t* ps = reinterpret_cast<int64_t*>(pos.data);
    // memcpy: the misaligned buffers may not be accessed through typed pointers.
    auto put_t = [](unsigned char* base, int64_t i, T v) { std::memcpy(base + i * sizeof(T), &v, sizeof v); };
    auto get_t = [](unsigned char const* base, int64_t i) {
        T v;
        std::memcpy(&v, base + i * sizeof(T), sizeof v);
        return v;
    };
    auto put_c = [](unsigned char* base, int64_t i, C v) { std::memcpy(base + i * sizeof(C), &v, sizeof v); };
    auto get_c = [](unsigned char const* base, int64_t i) {
        C v;
        std::memcpy(&v, base + i * sizeof(C), sizeof v);
        return v;
    };
    for (int64_t i = 0; i < n; ++i)
    {
        put_t(x.data, i, rope::from_float<T>(rnd()));
    }
    for (int64_t i = 0; i < cache_rows * half; ++i)
    {
        put_c(cosb.data, i, rope::from_float<C>(rnd()));
        put_c(sinb.data, i, rope::from_float<C>(rnd()));
    }
    // Positions: in range, both edges, and outside on both sides (incl. the int64 extremes).
    int64_t const specials[] = {-1, c.max_pos, c.max_pos - 1, 0, std::numeric_limits<int64_t>::min(),
        std::numeric_limits<int64_t>::max(), c.max_pos + 3, -7};
    for (int64_t i = 0; i < c.b * c.s; ++i)
    {
        ps[i] = (i % 3 == 1) ? specials[(i / 3) % 8] : static_cast<int64_t>(g_rng % static_cast<uint64_t>(c.max_pos));
        g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    }
    std::memset(out.data, 0xAB, out.bytes); // garbage: every element must be written

    RopeTwinArgs a{};
    a.x = x.data;
    a.cos_cache = cosb.data;
    a.sin_cache = sinb.data;
    a.position_ids = c.with_pos ? ps : nullptr;
    a.out = out.data;
    a.x_dtype = name_of<T>();
    a.cos_dtype = a.sin_dtype = name_of<C>();
    a.position_ids_dtype = "int64";
    if (c.bhsd)
    {
        int64_t const shape[] = {c.b, c.h, c.s, c.d};
        std::memcpy(a.x_shape, shape, sizeof shape);
        a.x_rank = 4;
    }
    else
    {
        int64_t const shape[] = {c.b, c.s, c.h * c.d};
        std::memcpy(a.x_shape, shape, sizeof shape);
        a.x_rank = 3;
    }
    if (c.with_pos)
    {
        a.cos_shape[0] = a.sin_shape[0] = c.max_pos;
        a.cos_shape[1] = a.sin_shape[1] = half;
        a.cos_rank = a.sin_rank = 2;
        a.position_ids_shape[0] = c.b;
        a.position_ids_shape[1] = c.s;
        a.position_ids_rank = 2;
    }
    else
    {
        a.cos_shape[0] = a.sin_shape[0] = c.b;
        a.cos_shape[1] = a.sin_shape[1] = c.s;
        a.cos_shape[2] = a.sin_shape[2] = half;
        a.cos_rank = a.sin_rank = 3;
        a.position_ids_rank = -1;
    }
    a.interleaved = c.interleaved;
    a.num_heads = c.bhsd ? 0 : c.h;
    a.rotary_embedding_dim = c.rd_attr;
    a.force_scalar = c.force_scalar;
    a.block_end = -1;
    a.x_bytes = static_cast<int64_t>(x.bytes);
    a.cos_bytes = static_cast<int64_t>(cosb.bytes);
    a.sin_bytes = static_cast<int64_t>(sinb.bytes);
    a.position_ids_bytes = static_cast<int64_t>(pos.bytes);
    a.out_bytes = static_cast<int64_t>(out.bytes);
    RopeTwinPlan plan{};
    char err[512] = {};
    std::string const label = std::string(name_of<T>()) + "/" + name_of<C>() + " B=" + std::to_string(c.b)
        + " S=" + std::to_string(c.s) + " H=" + std::to_string(c.h) + " D=" + std::to_string(c.d) + " rd="
        + std::to_string(rd) + (c.bhsd ? " 4-D" : " 3-D") + (c.interleaved ? " interleaved" : "")
        + (c.with_pos ? " pos" : "") + (c.force_scalar ? " scalar" : "") + " misalign=" + std::to_string(c.misalign);
    if (rope_twin_run(&a, &plan, err, sizeof err) != 0)
    {
        fail(label + ": " + err);
        return;
    }
    // position_ids are read one int64 at a time on both paths: their address never decides the path.
    bool const may_vectorize = !c.force_scalar && (c.misalign == 0 || c.misalign == 7) && c.d % (16 / sizeof(T)) == 0
        && half % (c.interleaved ? 8 / sizeof(T) : 16 / sizeof(T)) == 0;
    if (c.force_scalar && plan.vectorized)
    {
        fail(label + ": force_scalar still took the vector path");
    }
    if (plan.vectorized != may_vectorize)
    {
        fail(label + (plan.vectorized ? ": took the vector path on unaligned data" : ": missed the vector path"));
    }
    g_vectorized += plan.vectorized ? 1 : 0;
    g_scalar_misaligned += (c.misalign != 0 && c.misalign != 7 && !c.force_scalar) ? 1 : 0;
    // The contract, element by element.
    for (int64_t bi = 0; bi < c.b; ++bi)
    {
        for (int64_t si = 0; si < c.s; ++si)
        {
            int64_t const tok = bi * c.s + si;
            int64_t const p = c.with_pos ? ps[tok] : tok;
            bool const pass = c.with_pos && (p < 0 || p >= c.max_pos);
            for (int64_t hi = 0; hi < c.h; ++hi)
            {
                int64_t const row = c.bhsd ? ((bi * c.h + hi) * c.s + si) * c.d : ((bi * c.s + si) * c.h + hi) * c.d;
                for (int64_t di = 0; di < c.d; ++di)
                {
                    float const xv = rope::to_float(get_t(x.data, row + di));
                    float expect = xv;
                    if (!pass && di < rd)
                    {
                        int64_t const k = c.interleaved ? di / 2 : di % half;
                        bool const first = c.interleaved ? di % 2 == 0 : di < half;
                        int64_t const mate = c.interleaved ? (first ? di + 1 : di - 1) : (first ? di + half : di - half);
                        float const cv = rope::to_float(get_c(cosb.data, p * half + k));
                        float const sv = rope::to_float(get_c(sinb.data, p * half + k));
                        float const mv = rope::to_float(get_t(x.data, row + mate));
                        expect = first ? xv * cv - mv * sv : mv * sv + xv * cv;
                    }
                    float const got = rope::to_float(get_t(out.data, row + di));
                    float const want = rope::to_float(rope::from_float<T>(expect));
                    if (!(std::fabs(got - want) <= tol_of<T>() * (1.0f + std::fabs(want))))
                    {
                        fail(label + ": element (" + std::to_string(bi) + "," + std::to_string(si) + ","
                            + std::to_string(hi) + "," + std::to_string(di) + ") got " + std::to_string(got)
                            + " want " + std::to_string(want));
                        return;
                    }
                }
            }
        }
    }
}

template <class T, class C>
void run_all()
{
    // Odd sizes, tails, sizes that allow and that defeat the vector path.
    int64_t const dims[][3] = {{2, 0, 0}, {6, 4, 0}, {8, 0, 0}, {10, 6, 0}, {16, 0, 0}, {24, 16, 0}, {32, 8, 0},
        {64, 0, 0}, {72, 64, 0}, {80, 32, 0}, {130, 0, 0}};
    int64_t const sizes[][3] = {{1, 1, 1}, {1, 5, 3}, {3, 7, 2}, {2, 2, 5}};
    int k = 0;
    for (auto const& dm : dims)
    {
        for (int variant = 0; variant < 8; ++variant)
        {
            auto const& sz = sizes[(k++) % 4];
            Case c{};
            c.b = sz[0];
            c.s = sz[1];
            c.h = sz[2];
            c.d = dm[0];
            c.rd_attr = dm[1];
            c.bhsd = variant & 1;
            c.interleaved = (variant >> 1) & 1;
            c.with_pos = (variant >> 2) & 1;
            c.max_pos = 5;
            for (int misalign = 0; misalign < 8; ++misalign)
            {
                for (int scalar = 0; scalar < (misalign < 3 ? 2 : 1); ++scalar)
                {
                    c.misalign = misalign;
                    c.force_scalar = scalar;
                    run_case<T, C>(c);
                }
            }
        }
    }
    // Empty tensors: nothing to do, nothing read.
    run_case<T, C>(Case{0, 3, 2, 8, 0, true, false, true, false, 0, 4});
    run_case<T, C>(Case{2, 0, 2, 8, 0, false, true, false, false, 0, 4});
}


void field_cases()
{
    char err[512];
    int64_t out[3];
    // A CHAR field (plugin_namespace) without a NUL terminator, allocated at exactly its length.
    {
        std::unique_ptr<char[]> s(new char[11]);
        std::memcpy(s.get(), "rope_export", 11);
        int32_t const one = 1;
        RopeField f[] = {{"plugin_namespace", s.get(), 6, 11}, {"num_heads", &one, 5, 1}};
        ++g_cases;
        if (rope_parse_fields(f, 2, 1, out, err, sizeof err) == 0)
        {
            fail("runtime fields without interleaved/rotary_embedding_dim were accepted");
        }
        if (rope_parse_fields(f, 2, 0, out, err, sizeof err) != 0 || out[1] != 1)
        {
            fail(std::string("build fields with an unterminated plugin_namespace: ") + err);
        }
    }
    // A name of 1025 bytes with no terminator: must be refused without reading past it.
    {
        std::unique_ptr<char[]> name(new char[1025]);
        std::memset(name.get(), 'a', 1025);
        int32_t const v = 0;
        RopeField f[] = {{name.get(), &v, 5, 1}};
        check_rejects("a 1025-byte field name", rope_parse_fields(f, 1, 0, out, err, sizeof err), err);
    }
    // INT64 data at an odd address, exactly 8 bytes long.
    {
        std::unique_ptr<unsigned char[]> mem(new unsigned char[9]);
        int64_t const v = 64;
        std::memcpy(mem.get() + 1, &v, 8);
        RopeField f[] = {{"rotary_embedding_dim", mem.get() + 1, 10, 1}};
        ++g_cases;
        if (rope_parse_fields(f, 1, 0, out, err, sizeof err) != 0 || out[2] != 64)
        {
            fail(std::string("unaligned INT64 field: ") + err);
        }
    }
    int32_t const two[2] = {1, 1};
    int32_t const bad = 3;
    int32_t const odd = 7;
    int32_t const neg = -2;
    float const flt = 1.0f;
    RopeField const bads[][1] = {
        {{"interleaved", two, 5, 2}},
        {{"interleaved", &bad, 5, 1}},
        {{"interleaved", nullptr, 5, 1}},
        {{"interleaved", two, 5, 0}},
        {{"num_heads", &neg, 5, 1}},
        {{"num_heads", &flt, 1, 1}},
        {{"num_heads", &bad, 99, 1}},
        {{"rotary_embedding_dim", &odd, 5, 1}},
        {{"rotary_embedding_dim", &neg, 5, 1}},
        {{"num_head", &bad, 5, 1}},
        {{nullptr, &bad, 5, 1}},
    };
    for (auto const& f : bads)
    {
        check_rejects(f[0].name ? f[0].name : "(null name)", rope_parse_fields(f, 1, 0, out, err, sizeof err), err);
    }
    RopeField const dup[] = {{"num_heads", &bad, 5, 1}, {"num_heads", &bad, 5, 1}};
    check_rejects("a duplicate field", rope_parse_fields(dup, 2, 0, out, err, sizeof err), err);
    check_rejects("a null field array", rope_parse_fields(nullptr, 2, 0, out, err, sizeof err), err);
    check_rejects("a negative field count", rope_parse_fields(dup, -1, 0, out, err, sizeof err), err);
    // Round trip through serialization.
    RopeField sf[3];
    int32_t sv[3];
    ++g_cases;
    if (rope_serialize_fields(1, 32, 64, sf, sv, err, sizeof err) != 0
        || rope_parse_fields(sf, 3, 1, out, err, sizeof err) != 0 || out[0] != 1 || out[1] != 32 || out[2] != 64)
    {
        fail("serialized fields do not parse back");
    }
}

void shape_cases()
{
    char err[512];
    RopeGeometry g;
    int64_t const big = int64_t{1} << 40;
    int64_t const x[] = {big, big, 8, 64};
    int64_t const cs[] = {big, big, 32};
    check_rejects("an X whose element count overflows int64",
        rope_resolve_shape(x, 4, cs, 3, cs, 3, nullptr, -1, 0, 0, 0, &g, err, sizeof err), err);
    int64_t const neg[] = {1, -1, 8, 64};
    check_rejects("a negative dimension",
        rope_resolve_shape(neg, 4, cs, 3, cs, 3, nullptr, -1, 0, 0, 0, &g, err, sizeof err), err);
    check_rejects(
        "rank 9", rope_resolve_shape(x, 9, cs, 3, cs, 3, nullptr, -1, 0, 0, 0, &g, err, sizeof err), err);
    // Format queries with out-of-range positions and null names must answer "no", not crash.
    char const* names[] = {"float16", "float32", "float32", "int64", "float16"};
    int32_t const lin[] = {1, 1, 1, 1, 1};
    ++g_cases;
    if (rope_supports_combination(-1, names, lin, 4, 1) || rope_supports_combination(5, names, lin, 4, 1)
        || rope_supports_combination(0, names, lin, 7, 1) || !rope_supports_combination(4, names, lin, 4, 1))
    {
        fail("supports_combination answers wrongly at the edges");
    }
    char const* nulls[] = {nullptr, nullptr, nullptr};
    char outname[32];
    check_rejects("null dtype names", rope_output_dtype(nulls, 3, 1, outname, sizeof outname, err, sizeof err), err);
}

} // namespace

int main()
{
    run_all<float, float>();
    run_all<rope::f16, rope::f16>();
    run_all<rope::f16, float>();
    run_all<rope::bf16, rope::bf16>();
    run_all<rope::bf16, float>();
    element_misaligned_cases<float, float>();
    element_misaligned_cases<rope::f16, rope::f16>();
    element_misaligned_cases<rope::bf16, float>();
    field_cases();
    serializer_cases();
    shape_cases();
    null_pointer_cases();
    size_cases();
    if (g_failures)
    {
        std::fprintf(stderr, "twin sanitizer driver: %d of %d cases failed\n", g_failures, g_cases);
        return 1;
    }
    std::printf("twin sanitizer driver: %d cases ok (%d on the vector path)\n", g_cases, g_vectorized);
    std::printf("null pointers refused: %d\nelement-misaligned pointers refused: %d\n"
                "misaligned by one element, run on the scalar path: %d\ncounts and sizes past the memory refused: %d\n",
        g_refused_null, g_refused_misaligned, g_scalar_misaligned, g_refused_sizes);
    return 0;
}
