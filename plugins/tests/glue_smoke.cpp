// Drives the real IPluginV3 glue, loaded with dlopen like polygraphy and Triton load it, against
// fake_nvinfer.cpp's registry: static registration, the getCreators/setLoggerFinder entry points,
// creation from good and tampered fields, serialization round trip, type/format/shape decisions,
// and enqueue's refusal of bad shapes. No GPU is touched: the one enqueue that passes is empty.
//
//   rope_export_glue_smoke path/to/librope_export_trt_plugin_fake_nvinfer.so
#include <NvInferRuntime.h>

#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

extern "C" char const* fake_registered_namespace(char const* name, char const* version, char const* ns);

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

} // namespace

int main(int argc, char** argv)
{
    if (argc != 2)
    {
        std::fprintf(stderr, "usage: %s PLUGIN_LIBRARY\n", argv[0]);
        return 2;
    }
    void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr)
    {
        std::fprintf(stderr, "dlopen: %s\n", dlerror());
        return 1;
    }
    // Static registration happened on load, under the creator's own namespace.
    char const* ns = fake_registered_namespace("RotaryEmbedding", "1", "rope_export");
    check(ns != nullptr && std::strcmp(ns, "rope_export") == 0, "dlopen registers RotaryEmbedding/1/rope_export");

    using GetCreators = nvinfer1::IPluginCreatorInterface* const* (*) (int32_t&);
    using SetLoggerFinder = void (*)(nvinfer1::ILoggerFinder*);
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
    auto* creator = static_cast<nvinfer1::IPluginCreatorV3One*>(creators[0]);
    check(std::strcmp(creator->getPluginName(), "RotaryEmbedding") == 0 && std::strcmp(creator->getPluginVersion(), "1") == 0
            && std::strcmp(creator->getPluginNamespace(), "rope_export") == 0,
        "creator identity");
    PluginFieldCollection const* names = creator->getFieldNames();
    check(names->nbFields == 3 && std::strcmp(names->fields[2].name, "rotary_embedding_dim") == 0, "getFieldNames");

    // Fields as the ONNX parser passes them (string attributes without NUL).
    int32_t const inter = 0;
    int32_t const heads = 0;
    int32_t const rd = 64;
    char const nsv[] = {'r', 'o', 'p', 'e', '_', 'e', 'x', 'p', 'o', 'r', 't'};
    PluginField good[] = {PluginField("interleaved", &inter, PluginFieldType::kINT32, 1),
        PluginField("num_heads", &heads, PluginFieldType::kINT32, 1),
        PluginField("rotary_embedding_dim", &rd, PluginFieldType::kINT32, 1),
        PluginField("plugin_namespace", nsv, PluginFieldType::kCHAR, 11)};
    PluginFieldCollection fc{4, good};
    nvinfer1::IPluginV3* plugin = creator->createPlugin("layer0", &fc, nvinfer1::TensorRTPhase::kBUILD);
    check(plugin != nullptr, "createPlugin from parser fields");
    if (plugin == nullptr)
    {
        return 1;
    }
    auto* core = static_cast<nvinfer1::IPluginV3OneCore*>(plugin->getCapabilityInterface(nvinfer1::PluginCapabilityType::kCORE));
    auto* build
        = static_cast<nvinfer1::IPluginV3OneBuild*>(plugin->getCapabilityInterface(nvinfer1::PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<nvinfer1::IPluginV3OneRuntime*>(
        plugin->getCapabilityInterface(nvinfer1::PluginCapabilityType::kRUNTIME));
    check(core && build && runtime, "all three capabilities");
    check(std::strcmp(core->getPluginNamespace(), "rope_export") == 0, "plugin namespace");
    check(std::strcmp(build->getMetadataString(), "interleaved=0 num_heads=0 rotary_embedding_dim=64") == 0, "metadata");
    check(build->getNbOutputs() == 1, "one output");

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

    // Serialization round trip, through clone and attachToContext.
    nvinfer1::IPluginV3* attached = runtime->attachToContext(nullptr);
    auto* attached_runtime = static_cast<nvinfer1::IPluginV3OneRuntime*>(
        attached->getCapabilityInterface(nvinfer1::PluginCapabilityType::kRUNTIME));
    PluginFieldCollection const* saved = attached_runtime->getFieldsToSerialize();
    nvinfer1::IPluginV3* restored = creator->createPlugin("layer0", saved, nvinfer1::TensorRTPhase::kRUNTIME);
    check(restored != nullptr, "serialized fields deserialize");
    if (restored != nullptr)
    {
        auto* rb = static_cast<nvinfer1::IPluginV3OneBuild*>(restored->getCapabilityInterface(nvinfer1::PluginCapabilityType::kBUILD));
        check(std::strcmp(rb->getMetadataString(), "interleaved=0 num_heads=0 rotary_embedding_dim=64") == 0,
            "round trip keeps the attributes");
        delete restored;
    }

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
    if (gFailures)
    {
        std::fprintf(stderr, "glue smoke test: %d checks failed\n", gFailures);
        return 1;
    }
    std::printf("glue smoke test: ok\n");
    return 0;
}
