// Storage types, conversions and vector loads shared by the CUDA kernels and their CPU twin.
//
// Under nvcc the half types are CUDA's own; under a plain host compiler they are 16-bit structs
// with software round-to-nearest-even conversions, so the same templated code builds for both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

// Unrolled loops over the elements of one pack; pragma spelling differs per compiler.
#if defined(__CUDACC__) || defined(__clang__)
#define ROPE_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define ROPE_UNROLL _Pragma("GCC unroll 16")
#else
#define ROPE_UNROLL
#endif

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define ROPE_HD __host__ __device__ __forceinline__
#else
#define ROPE_HD inline
#endif

namespace rope
{

#if defined(__CUDACC__)
using f16 = __half;
using bf16 = __nv_bfloat16;

ROPE_HD float to_float(__half v)
{
    return __half2float(v);
}
ROPE_HD float to_float(__nv_bfloat16 v)
{
    return __bfloat162float(v);
}
template <class T>
ROPE_HD T from_float(float v);
template <>
ROPE_HD __half from_float<__half>(float v)
{
    return __float2half_rn(v);
}
template <>
ROPE_HD __nv_bfloat16 from_float<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}
#else
struct f16
{
    uint16_t bits;
};
struct bf16
{
    uint16_t bits;
};

inline uint32_t float_bits(float f)
{
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}
inline float bits_float(uint32_t u)
{
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline float to_float(f16 v)
{
    uint32_t const sign = (uint32_t{v.bits} & 0x8000u) << 16;
    uint32_t const exp = (v.bits >> 10) & 0x1fu;
    uint32_t const mant = v.bits & 0x3ffu;
    if (exp == 0) // zero or subnormal: mant * 2^-24, exact in float
    {
        return bits_float(sign | float_bits(static_cast<float>(mant) * 5.9604644775390625e-8f));
    }
    if (exp == 31)
    {
        return bits_float(sign | 0x7f800000u | (mant << 13));
    }
    return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline float to_float(bf16 v)
{
    return bits_float(uint32_t{v.bits} << 16);
}

template <class T>
T from_float(float v);

template <>
inline f16 from_float<f16>(float v)
{
    uint32_t u = float_bits(v);
    uint16_t const sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    uint16_t bits;
    if (u >= 0x47800000u) // >= 2^16 (or inf/nan): inf, or a quiet nan
    {
        bits = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    }
    else if (u < 0x38800000u) // below 2^-14: subnormal half; let float addition round (RNE)
    {
        float const magic = bits_float(0x3f000000u); // 0.5: aligns 2^-24 with its last mantissa bit
        bits = static_cast<uint16_t>(float_bits(bits_float(u) + magic) - 0x3f000000u);
    }
    else // normal: rebias the exponent, round to nearest even on the 13 dropped bits
    {
        uint32_t const odd = (u >> 13) & 1u;
        u += 0xc8000fffu + odd; // (15 - 127) << 23, plus the rounding bias
        bits = static_cast<uint16_t>(u >> 13);
    }
    return f16{static_cast<uint16_t>(bits | sign)};
}

template <>
inline bf16 from_float<bf16>(float v)
{
    uint32_t const u = float_bits(v);
    if ((u & 0x7fffffffu) > 0x7f800000u)
    {
        return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)}; // keep nan a quiet nan
    }
    uint32_t const rounded = u + 0x7fffu + ((u >> 16) & 1u);
    return bf16{static_cast<uint16_t>(rounded >> 16)};
}
#endif

ROPE_HD float to_float(float v)
{
    return v;
}
template <>
ROPE_HD float from_float<float>(float v)
{
    return v;
}

// N elements of T moved as one aligned access: 128-bit (or 64/32-bit) loads and stores on the GPU.
constexpr size_t pack_align(size_t bytes)
{
    return bytes >= 16 ? 16 : bytes;
}

template <class T, int N>
struct alignas(pack_align(sizeof(T) * N)) Pack
{
    T v[N];
};

#if defined(__CUDA_ARCH__)
// Packs move as raw words: copying the pack itself lets nvcc split it into 16-bit accesses (the
// half types are classes); copying uint4 words gives one 128-bit access per 16 bytes.
template <size_t BYTES>
struct RawWord;
template <>
struct RawWord<16>
{
    using type = uint4;
};
template <>
struct RawWord<8>
{
    using type = uint2;
};
template <>
struct RawWord<4>
{
    using type = unsigned int;
};
template <>
struct RawWord<2>
{
    using type = unsigned short;
};

// Global accesses carry the alignment the vector path guarantees (can_vectorize), or the
// optimiser may split them at offsets it cannot prove aligned (such as x + half). Inputs are
// read-only for the kernel's lifetime, so loads go through the read-only data cache.
template <size_t BYTES>
__device__ __forceinline__ void load_words(void* local, void const* global)
{
    constexpr size_t kWord = BYTES >= 16 ? 16 : BYTES;
    using W = typename RawWord<kWord>::type;
    W const* g = static_cast<W const*>(__builtin_assume_aligned(global, kWord));
    W* l = static_cast<W*>(local);
#pragma unroll
    for (size_t i = 0; i < BYTES / kWord; ++i)
    {
        l[i] = __ldg(g + i);
    }
}

template <size_t BYTES>
__device__ __forceinline__ void store_words(void* global, void const* local)
{
    constexpr size_t kWord = BYTES >= 16 ? 16 : BYTES;
    using W = typename RawWord<kWord>::type;
    W* g = static_cast<W*>(__builtin_assume_aligned(global, kWord));
    W const* l = static_cast<W const*>(local);
#pragma unroll
    for (size_t i = 0; i < BYTES / kWord; ++i)
    {
        __stwb(g + i, l[i]); // an intrinsic store keeps the access whole
    }
}
#endif

#if !defined(__CUDA_ARCH__)
// The twin stops where the GPU would fault: an access the kernel believes aligned but is not.
inline void check_aligned(void const* p, size_t align)
{
    if (reinterpret_cast<uintptr_t>(p) % align != 0)
    {
        std::fprintf(stderr, "rope twin: misaligned %zu-byte access at %p\n", align, p);
        std::abort();
    }
}
#endif

template <class T, int N>
ROPE_HD Pack<T, N> load_pack(T const* p)
{
    Pack<T, N> r;
#if defined(__CUDA_ARCH__)
    load_words<sizeof(r)>(&r, p);
#else
    // Host: memcpy has no aliasing issues; the check keeps the twin honest about the alignment the
    // GPU path relies on (a misaligned vector access faults there).
    check_aligned(p, alignof(Pack<T, N>));
    std::memcpy(&r, p, sizeof r);
#endif
    return r;
}

template <class T, int N>
ROPE_HD void store_pack(T* p, Pack<T, N> const& v)
{
#if defined(__CUDA_ARCH__)
    store_words<sizeof(v)>(p, &v);
#else
    check_aligned(p, alignof(Pack<T, N>));
    std::memcpy(p, &v, sizeof v);
#endif
}

// N elements as N / W accesses of W elements each: W = N on the vector path, W = 1 on the scalar
// path, where only element alignment can be assumed (an interleaved pair is not one access there).
template <class T, int N, int W>
ROPE_HD Pack<T, N> load_elems(T const* p)
{
    static_assert(N % W == 0, "N must be a multiple of W");
    if constexpr (N == W)
    {
        return load_pack<T, N>(p);
    }
    else
    {
        Pack<T, N> r;
        ROPE_UNROLL
        for (int i = 0; i < N / W; ++i)
        {
            Pack<T, W> const q = load_pack<T, W>(p + i * W);
            ROPE_UNROLL
            for (int j = 0; j < W; ++j)
            {
                r.v[i * W + j] = q.v[j];
            }
        }
        return r;
    }
}

template <class T, int N, int W>
ROPE_HD void store_elems(T* p, Pack<T, N> const& v)
{
    static_assert(N % W == 0, "N must be a multiple of W");
    if constexpr (N == W)
    {
        store_pack<T, N>(p, v);
    }
    else
    {
        ROPE_UNROLL
        for (int i = 0; i < N / W; ++i)
        {
            Pack<T, W> q;
            ROPE_UNROLL
            for (int j = 0; j < W; ++j)
            {
                q.v[j] = v.v[i * W + j];
            }
            store_pack<T, W>(p + i * W, q);
        }
    }
}

} // namespace rope
