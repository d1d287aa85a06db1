// librope_export_trt_vc_plugin.so: the entry points of a TensorRT plugin library and nothing else,
// for IPluginRegistry::loadLibrary, trtexec --dynamicPlugins, setPluginsToSerialize and the lean
// runtime, like NVIDIA's libnvinfer_vc_plugin. Opening it registers nothing: loadLibrary registers
// what getCreators returns (and refuses creators that are already registered).
#include "plugin_log.h"
#include "rotary_plugin.h"
#include "tensorrt_runtime.h"

#include <NvInferVersion.h>

// Exported explicitly: TENSORRTAPI is empty outside TensorRT's own build, and we build with
// -fvisibility=hidden.
#define ROPE_PLUGIN_EXPORT __attribute__((visibility("default")))

extern "C" ROPE_PLUGIN_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    rope::set_logger_finder(finder);
}

extern "C" ROPE_PLUGIN_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    // Never null: a runtime may read the array before the count.
    static nvinfer1::IPluginCreatorInterface* const none[] = {nullptr};
    nbCreators = 0;
    try
    {
        std::string const mismatch = rope::major_mismatch(NV_TENSORRT_MAJOR, "librope_export_trt_vc_plugin.so");
        if (!mismatch.empty())
        {
            rope::set_logger_finder(nullptr); // another major version's logger has another ABI: stderr
            rope::log_error(mismatch);
            return none;
        }
        static rope::RotaryPluginCreator creator;
        static nvinfer1::IPluginCreatorInterface* const creators[] = {&creator};
        nbCreators = 1;
        return creators;
    }
    catch (...)
    {
    }
    return none;
}
