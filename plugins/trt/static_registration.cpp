// librope_export_trt_plugin.so: registers the creator when the library is opened (ctypes.CDLL,
// polygraphy --plugins, Triton's plugins=, trtexec --staticPlugins), like NVIDIA's libnvinfer_plugin.
//
// The library does not link libnvinfer. It reaches the registry of the TensorRT runtime the host has
// already loaded (libnvinfer, libnvinfer_lean or libnvinfer_dispatch of the headers' major version):
// dlopen(RTLD_NOLOAD) finds the loaded library and dlsym its getPluginRegistry/getLogger. In a process
// with none loaded yet it opens libnvinfer.so.<major> from the library search path, as
// libnvinfer_plugin's DT_NEEDED entry would; when that fails too it warns on stderr and registers
// nothing (load TensorRT first, or use librope_export_trt_vc_plugin.so through
// IPluginRegistry::loadLibrary). It exports no symbol.
#include "plugin_log.h"
#include "rotary_plugin.h"
#include "tensorrt_runtime.h"

#include <NvInferVersion.h>

#include <dlfcn.h>

namespace rope
{
namespace
{

constexpr char const* kLibrary = "librope_export_trt_plugin.so";

class StaticRegistrar
{
public:
    StaticRegistrar()
    {
        try
        {
            register_everywhere();
        }
        catch (...)
        {
        }
    }

private:
    static void register_everywhere()
    {
        using GetRegistry = nvinfer1::IPluginRegistry* (*) ();
        using GetLogger = nvinfer1::ILogger* (*) ();
        std::vector<LoadedRuntime> runtimes = loaded_runtimes(NV_TENSORRT_MAJOR);
        std::string const mismatch = runtimes.empty() ? major_mismatch(NV_TENSORRT_MAJOR, kLibrary) : "";
        if (runtimes.empty() && mismatch.empty())
        {
            std::string const soname = "libnvinfer.so." + std::to_string(NV_TENSORRT_MAJOR);
            if (void* handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_GLOBAL))
            {
                runtimes.push_back(LoadedRuntime{soname, handle});
            }
        }
        if (runtimes.empty())
        {
            log(nvinfer1::ILogger::Severity::kWARNING,
                std::string(kLibrary) + ": the plugin was NOT registered: "
                    + (mismatch.empty() ? "no TensorRT " + std::to_string(NV_TENSORRT_MAJOR)
                                + " runtime (libnvinfer, libnvinfer_lean or libnvinfer_dispatch .so."
                                + std::to_string(NV_TENSORRT_MAJOR)
                                + ") is loaded in this process yet, and libnvinfer.so."
                                + std::to_string(NV_TENSORRT_MAJOR)
                                + " is not on the library search path; load TensorRT first (import tensorrt), or "
                                  "register librope_export_trt_vc_plugin.so with IPluginRegistry::loadLibrary"
                                       : mismatch));
            return;
        }
        // Never destroyed: registries keep the pointer until the process ends.
        static RotaryPluginCreator* const creator = new RotaryPluginCreator();
        for (LoadedRuntime const& runtime : runtimes)
        {
            auto const get_registry = reinterpret_cast<GetRegistry>(dlsym(runtime.handle, "getPluginRegistry"));
            auto const get_logger = reinterpret_cast<GetLogger>(dlsym(runtime.handle, "getLogger"));
            if (get_logger != nullptr)
            {
                set_logger(get_logger());
            }
            nvinfer1::IPluginRegistry* registry = get_registry != nullptr ? get_registry() : nullptr;
            if (registry == nullptr)
            {
                continue; // e.g. a dispatch runtime without a registry of its own
            }
            if (!registry->registerCreator(*creator, kPluginNamespace))
            {
                log(nvinfer1::ILogger::Severity::kWARNING,
                    std::string(kLibrary) + ": " + kPluginName + " (version " + kPluginVersion + ", namespace "
                        + kPluginNamespace + ") is already registered in " + runtime.soname
                        + "'s registry (by librope_export_trt_vc_plugin.so or another copy of this library); "
                          "keeping that one");
            }
        }
    }
};

StaticRegistrar gStaticRegistrar;

} // namespace
} // namespace rope
