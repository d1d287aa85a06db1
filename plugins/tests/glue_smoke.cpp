// Drives the real IPluginV3 glue of librope_export_trt_vc_plugin.so: creation from good and tampered
// fields, serialization round trip through clone and attachToContext, type/format/shape decisions,
// configurePlugin/onShapeChange and enqueue's refusal of bad shapes. TensorRT's Python bindings reach
// none of these on a C++ plugin (their IPluginV3OneBuild/Runtime methods are documentation stubs), so
// tests/runtimes/test_trt_lean.py runs this driver. No GPU is touched: the one enqueue that passes is empty.
//
//   rope_export_glue_smoke VC_LIBRARY [TENSORRT_RUNTIME] [--dtype-table]
//
// With TENSORRT_RUNTIME (e.g. .../tensorrt_lean_libs/libnvinfer_lean.so.11) the creator comes from
// TensorRT's own registry: IPluginRegistry::loadLibrary, then getCreator, as the ONNX parser and
// engine deserialization find it; at the end deregisterLibrary must remove it again. Without it,
// straight from the library's getCreators. --dtype-table prints one JSON line per dtype combination
// (getOutputDataTypes and supportsFormatCombination over every TensorRT type the contract could
// meet) for the test to hold against rope_export.contract.
#include <NvInferRuntime.h>

#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

namespace
{

using nvinfer1::DataType;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;

int gFailures = 0;

void check(bool ok, char const* what)
{
    if (!ok)
    {
        std::fprintf(stderr, "FAIL: %s\n", what);
        ++gFailures;
    }
}

class CapturingLogger : public nvinfer1::ILogger
{
public:
    std::string last;
    void log(Severity, char const* msg) noexcept override
    {
        last = msg;
    }
};

class Finder : public nvinfer1::ILoggerFinder
{
public:
    CapturingLogger logger;
    nvinfer1::ILogger* findLogger() override
    {
        return &logger;
    }
};

Finder gFinder;

char const* type_name(DataType t)
{
    switch (t)
    {
    case DataType::kFLOAT: return "float32";
    case DataType::kHALF: return "float16";
    case DataType::kBF16: return "bfloat16";
    case DataType::kINT64: return "int64";
    case DataType::kINT32: return "int32";
    case DataType::kINT8: return "int8";
    case DataType::kBOOL: return "bool";
    default: return "other";
    }
}

std::string json_escape(std::string const& s)
{
    std::string out;
    for (char c : s)
    {
        if (c == '"' || c == '\\')
        {
            out += '\\';
        }
        out += c;
    }
    return out;
}

nvinfer1::PluginTensorDesc desc(DataType t, std::vector<int64_t> const& dims)
{
    nvinfer1::PluginTensorDesc d{};
    d.type = t;
    d.format = nvinfer1::TensorFormat::kLINEAR;
    d.dims.nbDims = static_cast<int32_t>(dims.size());
    for (size_t i = 0; i < dims.size(); ++i)
    {
        d.dims.d[i] = dims[i];
    }
    return d;
}

nvinfer1::DynamicPluginTensorDesc dyn(DataType t, std::vector<int64_t> const& dims)
{
    nvinfer1::DynamicPluginTensorDesc d{};
    d.desc = desc(t, dims);
    return d;
}

// Every combination of the types the contract names (and two it refuses) for 3 or 4 inputs + 1 output.
void print_dtype_table(nvinfer1::IPluginV3OneBuild* build)
{
    DataType const types[] = {DataType::kFLOAT, DataType::kHALF, DataType::kBF16, DataType::kINT64, DataType::kINT32,
        DataType::kINT8};
    for (int32_t nb_inputs : {3, 4})
    {
        int32_t const n = nb_inputs + 1;
        int64_t combos = 1;
        for (int32_t i = 0; i < n; ++i)
        {
            combos *= 6;
        }
        for (int64_t code = 0; code < combos; ++code)
        {
            nvinfer1::DynamicPluginTensorDesc io[5] = {};
            DataType in_types[4] = {};
            std::string names;
            int64_t rest = code;
            for (int32_t i = 0; i < n; ++i)
            {
                io[i] = dyn(types[rest % 6], {2, 8, -1, 64});
                rest /= 6;
                names += std::string(i ? "\", \"" : "\"") + type_name(io[i].desc.type);
                if (i < nb_inputs)
                {
                    in_types[i] = io[i].desc.type;
                }
            }
            bool accepted = true;
            for (int32_t pos = 0; pos < n; ++pos) // TensorRT asks position by position
            {
                accepted = accepted && build->supportsFormatCombination(pos, io, nb_inputs, 1);
            }
            DataType out_type{};
            gFinder.logger.last.clear();
            bool const typed = build->getOutputDataTypes(&out_type, 1, in_types, nb_inputs) == 0;
            std::printf("{\"types\": [%s\"], \"nb_inputs\": %d, \"accepted\": %s, \"output\": %s%s%s, \"error\": \"%s\"}\n",
                names.c_str(), nb_inputs, accepted ? "true" : "false", typed ? "\"" : "", typed ? type_name(out_type) : "null",
                typed ? "\"" : "", json_escape(gFinder.logger.last).c_str());
        }
    }
}

} // namespace

int main(int argc, char** argv)
{
    std::vector<std::string> args(argv + 1, argv + argc);
    bool table = false;
    std::vector<std::string> paths;
    for (std::string const& a : args)
    {
        if (a == "--dtype-table")
        {
            table = true;
        }
        else
        {
            paths.push_back(a);
        }
    }
    if (paths.empty() || paths.size() > 2)
    {
        std::fprintf(stderr, "usage: %s VC_LIBRARY [TENSORRT_RUNTIME] [--dtype-table]\n", argv[0]);
        return 2;
    }
    using SetLoggerFinder = void (*)(nvinfer1::ILoggerFinder*);
    nvinfer1::IPluginCreatorV3One* creator = nullptr;
    nvinfer1::IPluginRegistry* registry = nullptr;
    nvinfer1::IPluginRegistry::PluginLibraryHandle handle = nullptr;
    if (paths.size() == 2)
    {
        // TensorRT's registry: the runtime library is opened here, the plugin library by loadLibrary.
        void* runtime = dlopen(paths[1].c_str(), RTLD_NOW | RTLD_LOCAL);
        if (runtime == nullptr)
        {
            std::fprintf(stderr, "dlopen %s: %s\n", paths[1].c_str(), dlerror());
            return 1;
        }
        using GetRegistry = nvinfer1::IPluginRegistry* (*) ();
        auto get_registry = reinterpret_cast<GetRegistry>(dlsym(runtime, "getPluginRegistry"));
        registry = get_registry != nullptr ? get_registry() : nullptr;
        check(registry != nullptr, "the runtime exports getPluginRegistry");
        if (registry == nullptr)
        {
            return 1;
        }
        handle = registry->loadLibrary(paths[0].c_str());
        check(handle != nullptr, "IPluginRegistry::loadLibrary accepts the vc library");
        int32_t count = 0;
        nvinfer1::IPluginCreatorInterface* const* all = registry->getAllCreators(&count);
        int32_t ours = 0;
        for (int32_t i = 0; all != nullptr && i < count; ++i)
        {
            auto* c = static_cast<nvinfer1::IPluginCreatorV3One*>(all[i]);
            ours += std::strcmp(all[i]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0
                && std::strcmp(c->getPluginName(), "RopeExportRotaryEmbedding") == 0;
        }
        check(ours == 1, "exactly one RopeExportRotaryEmbedding creator in the registry");
        nvinfer1::IPluginCreatorInterface* found = registry->getCreator("RopeExportRotaryEmbedding", "1", "rope_export");
        check(found != nullptr && std::strcmp(found->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0,
            "getCreator finds an IPluginCreatorV3One by name, version and namespace");
        if (found == nullptr)
        {
            return 1;
        }
        creator = static_cast<nvinfer1::IPluginCreatorV3One*>(found);
        // loadLibrary gave the library TensorRT's logger finder; capture the messages instead.
        void* lib = dlopen(paths[0].c_str(), RTLD_NOW | RTLD_NOLOAD);
        auto set_finder = lib != nullptr ? reinterpret_cast<SetLoggerFinder>(dlsym(lib, "setLoggerFinder")) : nullptr;
        check(set_finder != nullptr, "the loaded library exports setLoggerFinder");
        if (set_finder == nullptr)
        {
            return 1;
        }
        set_finder(&gFinder);
    }
    else
    {
        void* lib = dlopen(paths[0].c_str(), RTLD_NOW | RTLD_LOCAL);
        if (lib == nullptr)
        {
            std::fprintf(stderr, "dlopen: %s\n", dlerror());
            return 1;
        }
        using GetCreators = nvinfer1::IPluginCreatorInterface* const* (*) (int32_t&);
        auto get_creators = reinterpret_cast<GetCreators>(dlsym(lib, "getCreators"));
        auto set_logger_finder = reinterpret_cast<SetLoggerFinder>(dlsym(lib, "setLoggerFinder"));
        check(get_creators && set_logger_finder, "getCreators and setLoggerFinder are exported");
        if (!get_creators || !set_logger_finder)
        {
            return 1;
        }
        set_logger_finder(&gFinder);
        int32_t n = 0;
        auto* const* creators = get_creators(n);
        check(n == 1 && std::strcmp(creators[0]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0,
            "getCreators returns one IPluginCreatorV3One");
        creator = static_cast<nvinfer1::IPluginCreatorV3One*>(creators[0]);
    }
    check(std::strcmp(creator->getPluginName(), "RopeExportRotaryEmbedding") == 0 && std::strcmp(creator->getPluginVersion(), "1") == 0
            && std::strcmp(creator->getPluginNamespace(), "rope_export") == 0,
        "creator identity");
    PluginFieldCollection const* names = creator->getFieldNames();
    check(names->nbFields == 3 && std::strcmp(names->fields[2].name, "rotary_embedding_dim") == 0, "getFieldNames");

    // Fields as the ONNX parser passes them: only the declared names, INT attributes as INT32 x 1.
    int32_t const inter = 0;
    int32_t const heads = 0;
    int32_t const rd = 64;
    PluginField good[] = {PluginField("interleaved", &inter, PluginFieldType::kINT32, 1),
        PluginField("num_heads", &heads, PluginFieldType::kINT32, 1),
        PluginField("rotary_embedding_dim", &rd, PluginFieldType::kINT32, 1)};
    PluginFieldCollection fc{3, good};
    nvinfer1::IPluginV3* plugin = creator->createPlugin("layer0", &fc, nvinfer1::TensorRTPhase::kBUILD);
    check(plugin != nullptr, "createPlugin from parser fields");
    if (plugin == nullptr)
    {
        return 1;
    }
    // The node's routing attributes, should a host pass every attribute: ignored, not refused.
    char const nsv[] = {'r', 'o', 'p', 'e', '_', 'e', 'x', 'p', 'o', 'r', 't'};
    PluginField routed[] = {good[0], good[1], good[2], PluginField("plugin_namespace", nsv, PluginFieldType::kCHAR, 11)};
    PluginFieldCollection routed_fc{4, routed};
    nvinfer1::IPluginV3* with_routing = creator->createPlugin("layer0", &routed_fc, nvinfer1::TensorRTPhase::kBUILD);
    check(with_routing != nullptr, "plugin_namespace as a CHAR field is ignored");
    delete with_routing;
    auto* core = static_cast<nvinfer1::IPluginV3OneCore*>(plugin->getCapabilityInterface(nvinfer1::PluginCapabilityType::kCORE));
    auto* build
        = static_cast<nvinfer1::IPluginV3OneBuild*>(plugin->getCapabilityInterface(nvinfer1::PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<nvinfer1::IPluginV3OneRuntime*>(
        plugin->getCapabilityInterface(nvinfer1::PluginCapabilityType::kRUNTIME));
    check(core && build && runtime, "all three capabilities");
    check(std::strcmp(core->getPluginNamespace(), "rope_export") == 0, "plugin namespace");
    check(std::strcmp(build->getMetadataString(), "interleaved=0 num_heads=0 rotary_embedding_dim=64") == 0, "metadata");
    check(build->getNbOutputs() == 1, "one output");
    if (table)
    {
        print_dtype_table(build);
    }
    nvinfer1::IPluginV3* cloned = plugin->clone();
    auto* cloned_build = cloned != nullptr ? static_cast<nvinfer1::IPluginV3OneBuild*>(
                             cloned->getCapabilityInterface(nvinfer1::PluginCapabilityType::kBUILD))
                                           : nullptr;
    check(cloned_build != nullptr
            && std::strcmp(cloned_build->getMetadataString(), "interleaved=0 num_heads=0 rotary_embedding_dim=64") == 0,
        "clone keeps the attributes");
    delete cloned;

    DataType out_type{};
    DataType const in_ok[] = {DataType::kHALF, DataType::kFLOAT, DataType::kFLOAT, DataType::kINT64};
    check(build->getOutputDataTypes(&out_type, 1, in_ok, 4) == 0 && out_type == DataType::kHALF, "output has X's type");
    DataType const in_bad[] = {DataType::kHALF, DataType::kHALF, DataType::kHALF, DataType::kINT32};
    check(build->getOutputDataTypes(&out_type, 1, in_bad, 4) != 0, "int32 position_ids refused");
    check(gFinder.logger.last.find("position_ids must be int64") != std::string::npos, "refusal logged via the finder");

    nvinfer1::DynamicPluginTensorDesc io[5] = {dyn(DataType::kBF16, {2, 8, -1, 128}), dyn(DataType::kFLOAT, {4096, 32}),
        dyn(DataType::kFLOAT, {4096, 32}), dyn(DataType::kINT64, {2, -1}), dyn(DataType::kBF16, {2, 8, -1, 128})};
    bool all = true;
    for (int32_t pos = 0; pos < 5; ++pos)
    {
        all = all && build->supportsFormatCombination(pos, io, 4, 1);
    }
    check(all, "bf16 X with fp32 caches and int64 positions is supported");
    io[4].desc.type = DataType::kFLOAT;
    check(!build->supportsFormatCombination(4, io, 4, 1), "output of another type refused");
    io[4].desc.type = DataType::kBF16;
    io[0].desc.format = nvinfer1::TensorFormat::kHWC8;
    check(!build->supportsFormatCombination(0, io, 4, 1), "non-linear format refused");
    io[0].desc.format = nvinfer1::TensorFormat::kLINEAR;
    check(build->configurePlugin(io, 4, io + 4, 1) == 0, "configurePlugin accepts the combination");
    nvinfer1::DynamicPluginTensorDesc bad_rank[5] = {io[0], dyn(DataType::kFLOAT, {2, 4096, 32}), io[2], io[3], io[4]};
    check(build->configurePlugin(bad_rank, 4, bad_rank + 4, 1) != 0, "configurePlugin refuses a rank-3 cache with positions");

    nvinfer1::PluginTensorDesc in[4] = {desc(DataType::kBF16, {2, 8, 5, 128}), desc(DataType::kFLOAT, {4096, 32}),
        desc(DataType::kFLOAT, {4096, 32}), desc(DataType::kINT64, {2, 5})};
    nvinfer1::PluginTensorDesc out = desc(DataType::kBF16, {2, 8, 5, 128});
    check(runtime->onShapeChange(in, 4, &out, 1) == 0, "onShapeChange accepts concrete shapes");
    in[3] = desc(DataType::kINT64, {2, 6});
    check(runtime->onShapeChange(in, 4, &out, 1) != 0, "onShapeChange refuses position_ids of the wrong shape");
    check(gFinder.logger.last.find("position_ids must be [B, S] = [2, 5], got [2, 6]") != std::string::npos,
        "shape refusal names the shapes");
    void const* ptrs[4] = {nullptr, nullptr, nullptr, nullptr};
    void* outs[1] = {nullptr};
    check(runtime->enqueue(in, &out, ptrs, outs, nullptr, nullptr) != 0, "enqueue refuses bad shapes without launching");
    in[3] = desc(DataType::kINT64, {0, 5});
    in[0] = desc(DataType::kBF16, {0, 8, 5, 128});
    out = in[0];
    check(runtime->onShapeChange(in, 4, &out, 1) == 0 && runtime->enqueue(in, &out, ptrs, outs, nullptr, nullptr) == 0,
        "an empty batch is a no-op");

    // Serialization round trip of a plugin with no default attribute, through attachToContext: the
    // fields TensorRT would store in the engine re-create an equal plugin, field for field.
    int32_t const values[3] = {1, 8, 32};
    PluginField custom[] = {PluginField("interleaved", &values[0], PluginFieldType::kINT32, 1),
        PluginField("num_heads", &values[1], PluginFieldType::kINT32, 1),
        PluginField("rotary_embedding_dim", &values[2], PluginFieldType::kINT32, 1)};
    PluginFieldCollection custom_fc{3, custom};
    nvinfer1::IPluginV3* original = creator->createPlugin("layer1", &custom_fc, nvinfer1::TensorRTPhase::kBUILD);
    check(original != nullptr, "createPlugin(1, 8, 32)");
    if (original == nullptr)
    {
        return 1;
    }
    auto* original_runtime = static_cast<nvinfer1::IPluginV3OneRuntime*>(
        original->getCapabilityInterface(nvinfer1::PluginCapabilityType::kRUNTIME));
    nvinfer1::IPluginV3* attached = original_runtime->attachToContext(nullptr);
    auto* attached_runtime = static_cast<nvinfer1::IPluginV3OneRuntime*>(
        attached->getCapabilityInterface(nvinfer1::PluginCapabilityType::kRUNTIME));
    auto* attached_build = static_cast<nvinfer1::IPluginV3OneBuild*>(
        attached->getCapabilityInterface(nvinfer1::PluginCapabilityType::kBUILD));
    check(std::strcmp(attached_build->getMetadataString(), "interleaved=1 num_heads=8 rotary_embedding_dim=32") == 0,
        "attachToContext keeps the attributes");
    PluginFieldCollection const* saved = attached_runtime->getFieldsToSerialize();
    bool saved_ok = saved != nullptr && saved->nbFields == 3;
    for (int32_t k = 0; saved_ok && k < 3; ++k)
    {
        PluginField const& f = saved->fields[k];
        int32_t v = 0;
        saved_ok = std::strcmp(f.name, names->fields[k].name) == 0 && f.type == PluginFieldType::kINT32 && f.length == 1
            && f.data != nullptr && (std::memcpy(&v, f.data, 4), v == values[k]);
    }
    check(saved_ok, "getFieldsToSerialize: the three declared fields, INT32 x 1, the plugin's values");
    nvinfer1::IPluginV3* restored = creator->createPlugin("layer1", saved, nvinfer1::TensorRTPhase::kRUNTIME);
    check(restored != nullptr, "serialized fields deserialize");
    if (restored != nullptr)
    {
        auto* rb = static_cast<nvinfer1::IPluginV3OneBuild*>(restored->getCapabilityInterface(nvinfer1::PluginCapabilityType::kBUILD));
        auto* rr = static_cast<nvinfer1::IPluginV3OneRuntime*>(
            restored->getCapabilityInterface(nvinfer1::PluginCapabilityType::kRUNTIME));
        check(std::strcmp(rb->getMetadataString(), "interleaved=1 num_heads=8 rotary_embedding_dim=32") == 0,
            "round trip keeps the attributes");
        PluginFieldCollection const* again = rr->getFieldsToSerialize();
        bool same = again != nullptr && again->nbFields == saved->nbFields;
        for (int32_t k = 0; same && k < again->nbFields; ++k)
        {
            same = std::strcmp(again->fields[k].name, saved->fields[k].name) == 0
                && again->fields[k].type == saved->fields[k].type && again->fields[k].length == saved->fields[k].length
                && std::memcmp(again->fields[k].data, saved->fields[k].data, 4) == 0;
        }
        check(same, "the restored plugin serializes to the same fields");
        delete restored;
    }
    delete original;

    // Tampered engines: wrong type, wrong length, out-of-range value, missing field.
    float const as_float = 64.0f;
    int32_t const odd = 63;
    int32_t const pair[2] = {1, 1};
    PluginField const tampered[][3] = {
        {good[0], good[1], PluginField("rotary_embedding_dim", &as_float, PluginFieldType::kFLOAT32, 1)},
        {good[0], good[1], PluginField("rotary_embedding_dim", &odd, PluginFieldType::kINT32, 1)},
        {PluginField("interleaved", pair, PluginFieldType::kINT32, 2), good[1], good[2]},
        {good[0], good[1], PluginField("rotary_embedding_dim", nullptr, PluginFieldType::kINT32, 1)},
    };
    for (auto const& t : tampered)
    {
        PluginFieldCollection tfc{3, t};
        nvinfer1::IPluginV3* p = creator->createPlugin("layer0", &tfc, nvinfer1::TensorRTPhase::kRUNTIME);
        check(p == nullptr && gFinder.logger.last.find("cannot create the plugin of layer 'layer0'") != std::string::npos,
            "tampered fields refused with a logged reason");
        delete p;
    }
    PluginFieldCollection missing{2, good};
    check(creator->createPlugin("layer0", &missing, nvinfer1::TensorRTPhase::kRUNTIME) == nullptr,
        "a serialized plugin without rotary_embedding_dim is refused");
    PluginFieldCollection null_fields{3, nullptr};
    check(creator->createPlugin("layer0", &null_fields, nvinfer1::TensorRTPhase::kBUILD) == nullptr,
        "a collection without its fields is refused");

    delete attached;
    delete plugin;
    if (registry != nullptr)
    {
        registry->deregisterLibrary(handle);
        check(registry->getCreator("RopeExportRotaryEmbedding", "1", "rope_export") == nullptr,
            "deregisterLibrary removes the creator");
    }
    if (gFailures)
    {
        std::fprintf(stderr, "glue smoke test: %d checks failed\n", gFailures);
        return 1;
    }
    std::printf("glue smoke test: ok\n");
    return 0;
}
