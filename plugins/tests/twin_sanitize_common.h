// Shared by the sanitizer driver's cases (twin_sanitize_driver.cpp and twin_sanitize_hostile.h):
// counters, failure reporting, exactly-sized buffers, dtype names. Included once, by the driver.
#pragma once

#include "../rotary/rotary_types.cuh"

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

namespace
{

int g_failures = 0;
int g_cases = 0;
int g_vectorized = 0;
int g_refused = 0;            // every refusal check_rejects saw
int g_refused_null = 0;       // null-pointer cases refused (section counts for the tests)
int g_refused_misaligned = 0; // element-misaligned cases refused
int g_refused_sizes = 0;      // counts and sizes past the memory given, refused
int g_scalar_misaligned = 0;  // element-aligned, not 16-byte aligned: ran, on the scalar path

void fail(std::string const& what)
{
    if (g_failures < 20)
    {
        std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    }
    ++g_failures;
}

// An exactly-sized heap buffer whose data starts `offset` bytes into the allocation.
struct Buffer
{
    std::unique_ptr<unsigned char[]> mem;
    unsigned char* data = nullptr;
    size_t bytes = 0;

    Buffer(size_t n, size_t offset)
        : mem(new unsigned char[n + offset])
        , data(mem.get() + offset)
        , bytes(n)
    {
    }
};

uint64_t g_rng = 0x9e3779b97f4a7c15ull;
float rnd()
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return static_cast<float>(static_cast<int64_t>(g_rng >> 40) - (1 << 23)) / static_cast<float>(1 << 22);
}

template <class T>
char const* name_of();
template <>
char const* name_of<float>()
{
    return "float32";
}
template <>
char const* name_of<rope::f16>()
{
    return "float16";
}
template <>
char const* name_of<rope::bf16>()
{
    return "bfloat16";
}

// A call that must be refused, with a message.
void check_rejects(char const* what, int32_t rc, char const* err)
{
    ++g_cases;
    if (rc == 0)
    {
        fail(std::string("accepted ") + what);
    }
    else if (err[0] == '\0')
    {
        fail(std::string("rejected ") + what + " without a message");
    }
    else
    {
        ++g_refused;
    }
}

} // namespace
