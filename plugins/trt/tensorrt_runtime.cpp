#include "tensorrt_runtime.h"

#include <dlfcn.h>

namespace rope
{
namespace
{
char const* const kRuntimeNames[] = {"libnvinfer.so.", "libnvinfer_lean.so.", "libnvinfer_dispatch.so."};
}

std::vector<LoadedRuntime> loaded_runtimes(int major)
{
    std::vector<LoadedRuntime> found;
    for (char const* name : kRuntimeNames)
    {
        std::string const soname = name + std::to_string(major);
        if (void* handle = dlopen(soname.c_str(), RTLD_LAZY | RTLD_NOLOAD))
        {
            found.push_back(LoadedRuntime{soname, handle});
        }
    }
    return found;
}

std::string other_major_runtimes(int major)
{
    std::string out;
    for (int m = 8; m <= 12; ++m)
    {
        if (m == major)
        {
            continue;
        }
        for (LoadedRuntime const& r : loaded_runtimes(m))
        {
            out += (out.empty() ? "" : ", ") + r.soname;
            dlclose(r.handle); // NOLOAD took a reference
        }
    }
    return out;
}

std::string major_mismatch(int major, char const* library)
{
    std::vector<LoadedRuntime> const ours = loaded_runtimes(major);
    for (LoadedRuntime const& r : ours)
    {
        dlclose(r.handle);
    }
    std::string const others = other_major_runtimes(major);
    if (!ours.empty() || others.empty())
    {
        return "";
    }
    return std::string(library) + " was built against TensorRT " + std::to_string(major)
        + " headers, but this process has another TensorRT major version loaded (" + others
        + "); rebuild it with TENSORRT_INCLUDE_DIR pointing at that version's include/ "
          "(rope-export build-plugin --tensorrt-include-dir ...)";
}

} // namespace rope
