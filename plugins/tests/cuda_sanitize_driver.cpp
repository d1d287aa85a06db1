// A sweep of the CUDA kernels through librope_export_cuda.so's C ABI, for compute-sanitizer:
//
//   compute-sanitizer --tool memcheck --error-exitcode 1 build/plugins/rope_export_cuda_sanitize
//
// Every tensor gets its own cudaMalloc of exactly its bytes (a misaligned tensor starts `offset`
// bytes into its allocation and still ends at its end), so memcheck sees any read or write past a
// tensor. Each case is also checked against the CPU twin (librope_export_twin.so, the same per-thread
// code on the host): rotated values within a few ulps (the GPU may fuse multiply-adds), pass-through
// tokens and channels bit for bit. Cases: dtype pairs x pair layout x X layout x full/partial rotary
// x positions (in and out of the cache, inf/NaN in passed tokens) or per-token caches x aligned or
// misaligned x vector or forced-scalar path, one tensor and q+k in one launch.
// Exit status: 0 clean, 1 mismatch or CUDA error, 77 no CUDA device.
#include "../cuda/rope_cuda_api.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace
{

struct Type
{
    char const* name;
    size_t size;
};
Type const kF32{"float32", 4};
Type const kF16{"float16", 2};
Type const kBF16{"bfloat16", 2};

uint32_t gSeed = 12345;
uint32_t next()
{
    gSeed = gSeed * 1664525u + 1013904223u;
    return gSeed >> 8;
}

float uniform()
{
    return static_cast<float>(next() % 20001) / 10000.0f - 1.0f;
}

uint16_t to_half_bits(float f) // round-to-nearest-even fp16, finite inputs in [-4, 4] plus inf/nan
{
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint32_t const sign = (u >> 16) & 0x8000u;
    if (std::isnan(f))
    {
        return static_cast<uint16_t>(sign | 0x7e00u);
    }
    if (std::isinf(f))
    {
        return static_cast<uint16_t>(sign | 0x7c00u);
    }
    float const a = std::fabs(f);
    if (a < 6.1035156e-05f)
    {
        return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a / 5.9604645e-08f)));
    }
    int e = 0;
    float const m = std::frexp(a, &e); // a = m * 2^e, m in [0.5, 1)
    uint32_t mant = static_cast<uint32_t>(std::nearbyint((m * 2.0f - 1.0f) * 1024.0f));
    int exp = e - 1 + 15;
    if (mant == 1024)
    {
        mant = 0;
        ++exp;
    }
    return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | mant);
}

float half_bits_to_float(uint16_t h)
{
    uint32_t const sign = (h & 0x8000u) ? 1u : 0u;
    int const exp = (h >> 10) & 0x1f;
    uint32_t const mant = h & 0x3ffu;
    float v;
    if (exp == 0)
    {
        v = static_cast<float>(mant) * 5.9604645e-08f;
    }
    else if (exp == 31)
    {
        v = mant ? NAN : INFINITY;
    }
    else
    {
        v = std::ldexp(1.0f + static_cast<float>(mant) / 1024.0f, exp - 15);
    }
    return sign ? -v : v;
}

void store(std::vector<unsigned char>& buf, size_t i, Type t, float v)
{
    if (t.size == 4)
    {
        std::memcpy(buf.data() + 4 * i, &v, 4);
        return;
    }
    uint16_t bits;
    if (std::strcmp(t.name, "float16") == 0)
    {
        bits = to_half_bits(v);
    }
    else
    {
        uint32_t u;
        std::memcpy(&u, &v, 4);
        bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); // RNE (finite and inf)
        if (std::isnan(v))
        {
            bits = 0x7fc0u;
        }
    }
    std::memcpy(buf.data() + 2 * i, &bits, 2);
}

float load(std::vector<unsigned char> const& buf, size_t i, Type t)
{
    if (t.size == 4)
    {
        float v;
        std::memcpy(&v, buf.data() + 4 * i, 4);
        return v;
    }
    uint16_t bits;
    std::memcpy(&bits, buf.data() + 2 * i, 2);
    if (std::strcmp(t.name, "float16") == 0)
    {
        return half_bits_to_float(bits);
    }
    uint32_t const u = static_cast<uint32_t>(bits) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
}

// One device tensor of exactly `bytes` bytes starting `offset` bytes into its allocation.
struct DeviceTensor
{
    void* base = nullptr;
    void* ptr = nullptr;
    DeviceTensor(std::vector<unsigned char> const& host, size_t offset)
    {
        size_t const bytes = host.size();
        if (cudaMalloc(&base, bytes + offset) != cudaSuccess)
        {
            std::fprintf(stderr, "cudaMalloc failed\n");
            std::exit(1);
        }
        ptr = static_cast<unsigned char*>(base) + offset;
        cudaMemcpy(ptr, host.data(), bytes, cudaMemcpyHostToDevice);
    }
    ~DeviceTensor()
    {
        cudaFree(base);
    }
    DeviceTensor(DeviceTensor const&) = delete;
    DeviceTensor& operator=(DeviceTensor const&) = delete;
};

struct Case
{
    Type x, cache;
    int interleaved;
    bool bhsd;
    int64_t batch, heads, seq, head_dim, rotary_dim, max_pos; // max_pos 0: per-token caches
    size_t misalign;                                           // elements
    int force_scalar;
};

struct HostCase
{
    std::vector<unsigned char> x, cos, sin, out_twin, out_gpu;
    std::vector<int64_t> pos;
    RopeTwinArgs args{};
};

void set_shape(int64_t* dst, int32_t& rank, std::vector<int64_t> const& dims)
{
    rank = static_cast<int32_t>(dims.size());
    for (size_t i = 0; i < dims.size(); ++i)
    {
        dst[i] = dims[i];
    }
}

void build(Case const& c, HostCase& h)
{
    int64_t const n = c.batch * c.heads * c.seq * c.head_dim;
    int64_t const half = c.rotary_dim / 2;
    int64_t const rows = c.max_pos > 0 ? c.max_pos : c.batch * c.seq;
    h.x.assign(static_cast<size_t>(n) * c.x.size, 0);
    h.cos.assign(static_cast<size_t>(rows * half) * c.cache.size, 0);
    h.sin.assign(h.cos.size(), 0);
    for (int64_t i = 0; i < n; ++i)
    {
        store(h.x, static_cast<size_t>(i), c.x, 4.0f * uniform());
    }
    for (int64_t i = 0; i < rows * half; ++i)
    {
        float const angle = 3.14159265f * uniform();
        store(h.cos, static_cast<size_t>(i), c.cache, std::cos(angle));
        store(h.sin, static_cast<size_t>(i), c.cache, std::sin(angle));
    }
    RopeTwinArgs& a = h.args;
    a = RopeTwinArgs{};
    a.x_dtype = c.x.name;
    a.cos_dtype = a.sin_dtype = c.cache.name;
    if (c.bhsd)
    {
        set_shape(a.x_shape, a.x_rank, {c.batch, c.heads, c.seq, c.head_dim});
    }
    else
    {
        set_shape(a.x_shape, a.x_rank, {c.batch, c.seq, c.heads * c.head_dim});
        a.num_heads = c.heads;
    }
    if (c.max_pos > 0)
    {
        set_shape(a.cos_shape, a.cos_rank, {c.max_pos, half});
        set_shape(a.position_ids_shape, a.position_ids_rank, {c.batch, c.seq});
        a.position_ids_dtype = "int64";
        h.pos.resize(static_cast<size_t>(c.batch * c.seq));
        for (size_t t = 0; t < h.pos.size(); ++t)
        {
            uint32_t const r = next() % 10;
            // Mostly in the cache; some before it, at its end, far past it (those tokens pass through).
            h.pos[t] = r < 7 ? static_cast<int64_t>(next() % static_cast<uint32_t>(c.max_pos))
                : r == 7     ? -1
                : r == 8     ? c.max_pos
                             : int64_t{1} << 40;
            if (r >= 7) // a passed token may hold inf/NaN: they must come out unchanged
            {
                int64_t const b = static_cast<int64_t>(t) / c.seq;
                int64_t const s = static_cast<int64_t>(t) % c.seq;
                size_t const at = static_cast<size_t>(
                    c.bhsd ? ((b * c.heads) * c.seq + s) * c.head_dim : (b * c.seq + s) * c.heads * c.head_dim);
                store(h.x, at, c.x, NAN);
                store(h.x, at + 1, c.x, -INFINITY);
            }
        }
    }
    else
    {
        set_shape(a.cos_shape, a.cos_rank, {c.batch, c.seq, half});
        a.position_ids_rank = -1;
    }
    std::memcpy(a.sin_shape, a.cos_shape, sizeof a.cos_shape);
    a.sin_rank = a.cos_rank;
    a.interleaved = c.interleaved;
    a.rotary_embedding_dim = c.rotary_dim == c.head_dim ? 0 : c.rotary_dim;
    a.force_scalar = c.force_scalar;
    a.block_begin = 0;
    a.block_end = -1;
    // the host and device copies alike hold exactly these bytes from their pointers on
    a.x_bytes = a.out_bytes = static_cast<int64_t>(h.x.size());
    a.cos_bytes = a.sin_bytes = static_cast<int64_t>(h.cos.size());
    a.position_ids_bytes = static_cast<int64_t>(h.pos.size() * sizeof(int64_t));
}

int gMismatches = 0;

void compare(Case const& c, HostCase const& h, char const* what)
{
    float const rel = c.x.size == 4 ? 1e-5f : (std::strcmp(c.x.name, "float16") == 0 ? 2e-3f : 1.6e-2f);
    size_t const n = h.out_twin.size() / c.x.size;
    for (size_t i = 0; i < n; ++i)
    {
        float const e = load(h.out_twin, i, c.x);
        float const g = load(h.out_gpu, i, c.x);
        bool const same_bits = std::memcmp(h.out_twin.data() + i * c.x.size, h.out_gpu.data() + i * c.x.size, c.x.size) == 0;
        if (same_bits || std::fabs(e - g) <= rel * (std::fabs(e) + 1.0f))
        {
            continue;
        }
        if (gMismatches++ < 10)
        {
            std::fprintf(stderr, "MISMATCH %s x=%s cache=%s inter=%d %s D=%lld rd=%lld max_pos=%lld misalign=%zu scalar=%d "
                                 "at %zu: gpu %g twin %g\n",
                what, c.x.name, c.cache.name, c.interleaved, c.bhsd ? "bhsd" : "bsd", static_cast<long long>(c.head_dim),
                static_cast<long long>(c.rotary_dim), static_cast<long long>(c.max_pos), c.misalign, c.force_scalar, i,
                static_cast<double>(g), static_cast<double>(e));
        }
        return;
    }
}

bool cuda_ok(cudaError_t rc, char const* what)
{
    if (rc != cudaSuccess)
    {
        std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(rc));
        return false;
    }
    return true;
}

// Runs the twin on the host copy, then the GPU (alone or with `other` in one launch), and compares.
bool run_case(Case const& c, Case const* other, cudaStream_t stream)
{
    HostCase h;
    HostCase k;
    build(c, h);
    if (other != nullptr)
    {
        build(*other, k);
    }
    char err[512];
    for (HostCase* hc : {&h, other != nullptr ? &k : nullptr})
    {
        if (hc == nullptr)
        {
            continue;
        }
        hc->out_twin.assign(hc->x.size(), 0);
        RopeTwinArgs a = hc->args;
        a.x = hc->x.data();
        a.cos_cache = hc->cos.data();
        a.sin_cache = hc->sin.data();
        a.position_ids = hc->pos.empty() ? nullptr : hc->pos.data();
        a.out = hc->out_twin.data();
        if (rope_twin_run(&a, nullptr, err, sizeof err) != 0)
        {
            std::fprintf(stderr, "twin refused a case: %s\n", err);
            return false;
        }
    }
    size_t const off = c.misalign * c.x.size;
    size_t const coff = c.misalign * c.cache.size;
    auto device_args = [&](HostCase& hc, std::vector<DeviceTensor*>& keep) {
        auto* x = new DeviceTensor(hc.x, off);
        auto* cs = new DeviceTensor(hc.cos, coff);
        auto* sn = new DeviceTensor(hc.sin, coff);
        std::vector<unsigned char> pos_bytes(hc.pos.size() * 8);
        std::memcpy(pos_bytes.data(), hc.pos.data(), pos_bytes.size());
        auto* pos = hc.pos.empty() ? nullptr : new DeviceTensor(pos_bytes, 0);
        std::vector<unsigned char> zeros(hc.x.size(), 0);
        auto* out = new DeviceTensor(zeros, off);
        keep.insert(keep.end(), {x, cs, sn, out});
        if (pos != nullptr)
        {
            keep.push_back(pos);
        }
        RopeTwinArgs a = hc.args;
        a.x = x->ptr;
        a.cos_cache = cs->ptr;
        a.sin_cache = sn->ptr;
        a.position_ids = pos != nullptr ? static_cast<int64_t const*>(pos->ptr) : nullptr;
        a.out = out->ptr;
        return std::make_pair(a, out);
    };
    std::vector<DeviceTensor*> keep;
    auto [da, out_a] = device_args(h, keep);
    int32_t rc = 0;
    DeviceTensor* out_b = nullptr;
    if (other == nullptr)
    {
        rc = rope_cuda_run(&da, nullptr, stream, err, sizeof err);
    }
    else
    {
        auto [db, ob] = device_args(k, keep);
        out_b = ob;
        int32_t fused = 0;
        rc = rope_cuda_run_pair(&da, &db, nullptr, &fused, stream, err, sizeof err);
    }
    bool ok = rc == 0 || (std::fprintf(stderr, "launch refused: %s\n", err), false);
    ok = ok && cuda_ok(cudaStreamSynchronize(stream), "kernel");
    if (ok)
    {
        h.out_gpu.assign(h.x.size(), 0);
        ok = cuda_ok(cudaMemcpy(h.out_gpu.data(), out_a->ptr, h.x.size(), cudaMemcpyDeviceToHost), "copy");
        compare(c, h, other == nullptr ? "single" : "pair q");
        if (out_b != nullptr && ok)
        {
            k.out_gpu.assign(k.x.size(), 0);
            ok = cuda_ok(cudaMemcpy(k.out_gpu.data(), out_b->ptr, k.x.size(), cudaMemcpyDeviceToHost), "copy");
            compare(*other, k, "pair k");
        }
    }
    for (DeviceTensor* t : keep)
    {
        delete t;
    }
    return ok;
}

} // namespace

int main()
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1)
    {
        std::fprintf(stderr, "rope_export_cuda_sanitize: no CUDA device; the sweep needs a GPU\n");
        return 77;
    }
    char err[512];
    if (rope_cuda_device_check(err, sizeof err) != 0)
    {
        std::fprintf(stderr, "%s\n", err);
        return 1;
    }
    cudaStream_t stream = nullptr;
    if (!cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream"))
    {
        return 1;
    }
    Type const xs[] = {kF32, kF16, kBF16};
    int cases = 0;
    bool ok = true;
    for (Type const& xt : xs)
    {
        for (bool f32_cache : {false, true})
        {
            if (f32_cache && xt.size == 4)
            {
                continue;
            }
            Type const ct = f32_cache ? kF32 : xt;
            for (int inter : {0, 1})
            {
                for (bool bhsd : {true, false})
                {
                    // (head_dim, rotary_dim): whole head, partial with a vector tail, partial with a scalar tail
                    int64_t const dims[][2] = {{64, 64}, {64, 32}, {80, 32}, {6, 4}};
                    for (auto const& d : dims)
                    {
                        for (int64_t max_pos : {int64_t{0}, int64_t{37}})
                        {
                            for (size_t misalign : {size_t{0}, size_t{1}})
                            {
                                for (int scalar : {0, 1})
                                {
                                    Case const c{xt, ct, inter, bhsd, 2, 3, 5, d[0], d[1], max_pos, misalign, scalar};
                                    ok = run_case(c, nullptr, stream) && ok;
                                    Case k = c;
                                    k.heads = 1; // GQA: k has fewer heads, same kernel, one launch
                                    ok = run_case(c, &k, stream) && ok;
                                    cases += 2;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    cudaStreamDestroy(stream);
    std::printf("rope_export_cuda_sanitize: %d cases, %d mismatches against the CPU twin%s\n", cases, gMismatches,
        ok ? "" : ", CUDA errors (see above)");
    return ok && gMismatches == 0 ? 0 : 1;
}
