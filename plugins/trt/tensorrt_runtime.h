// The TensorRT runtime libraries already loaded in this process, found without linking libnvinfer:
// the plugin libraries build with TensorRT's headers alone and reach the plugin registry of
// whichever runtime (full, lean or dispatch) the host loaded.
#pragma once

#include <string>
#include <vector>

namespace rope
{

struct LoadedRuntime
{
    std::string soname; // e.g. "libnvinfer_lean.so.11"
    void* handle;       // from dlopen(RTLD_NOLOAD): never loads a library that is not there yet
};

// Runtimes of TensorRT major version `major` in this process (libnvinfer, libnvinfer_lean,
// libnvinfer_dispatch), in that order.
std::vector<LoadedRuntime> loaded_runtimes(int major);

// "libnvinfer_lean.so.10, ..." for every other major version loaded (8 to 12), or "".
std::string other_major_runtimes(int major);

// Why a library built against TensorRT `major` headers must not serve this process, or "" when it may:
// another major version is loaded and `major` is not.
std::string major_mismatch(int major, char const* library);

} // namespace rope
