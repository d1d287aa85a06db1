// A stand-in for libnvinfer's plugin registry, for machines with TensorRT's headers but not its
// libraries: just enough (getPluginRegistry) for the plugin library to link and register itself,
// so glue_smoke.cpp can drive the real glue. Never shipped: it lives in the build's tests/ folder.
#include <NvInferRuntime.h>

#include <cstring>
#include <string>
#include <vector>

namespace
{

struct Entry
{
    nvinfer1::IPluginCreatorInterface* creator;
    std::string ns; // the namespace passed to registerCreator
};

// The creators' identity, for V3 creators (the only kind the rotary plugin has).
nvinfer1::IPluginCreatorV3One* as_v3(nvinfer1::IPluginCreatorInterface* c)
{
    return std::strcmp(c->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0
        ? static_cast<nvinfer1::IPluginCreatorV3One*>(c)
        : nullptr;
}

class FakeRegistry : public nvinfer1::IPluginRegistry
{
public:
    std::vector<Entry> entries;
    std::vector<nvinfer1::IPluginCreatorInterface*> list;

    bool registerCreator(nvinfer1::IPluginCreatorInterface& creator, char const* const ns) noexcept override
    {
        auto* v3 = as_v3(&creator);
        if (v3 == nullptr || getCreator(v3->getPluginName(), v3->getPluginVersion(), v3->getPluginNamespace()))
        {
            return false; // TensorRT refuses duplicates too
        }
        entries.push_back(Entry{&creator, ns ? ns : ""});
        return true;
    }
    nvinfer1::IPluginCreatorInterface* getCreator(
        char const* const name, char const* const version, char const* const ns) noexcept override
    {
        for (auto const& e : entries)
        {
            auto* v3 = as_v3(e.creator);
            if (v3 && std::strcmp(v3->getPluginName(), name) == 0 && std::strcmp(v3->getPluginVersion(), version) == 0
                && std::strcmp(v3->getPluginNamespace(), ns) == 0)
            {
                return e.creator;
            }
        }
        return nullptr;
    }
    nvinfer1::IPluginCreatorInterface* const* getAllCreators(int32_t* const n) const noexcept override
    {
        *n = 0;
        return nullptr;
    }
    bool deregisterCreator(nvinfer1::IPluginCreatorInterface const& creator) noexcept override
    {
        for (auto it = entries.begin(); it != entries.end(); ++it)
        {
            if (it->creator == &creator)
            {
                entries.erase(it);
                return true;
            }
        }
        return false;
    }
    void setErrorRecorder(nvinfer1::IErrorRecorder* const) noexcept override {}
    nvinfer1::IErrorRecorder* getErrorRecorder() const noexcept override
    {
        return nullptr;
    }
    bool isParentSearchEnabled() const override
    {
        return false;
    }
    void setParentSearchEnabled(bool const) override {}
    PluginLibraryHandle loadLibrary(char const*) noexcept override
    {
        return nullptr;
    }
    void deregisterLibrary(PluginLibraryHandle) noexcept override {}
    nvinfer1::IPluginResource* acquirePluginResource(char const*, nvinfer1::IPluginResource*) noexcept override
    {
        return nullptr;
    }
    int32_t releasePluginResource(char const*) noexcept override
    {
        return 0;
    }
    nvinfer1::IPluginCreatorInterface* const* getAllCreatorsRecursive(int32_t* const n) noexcept override
    {
        *n = 0;
        return nullptr;
    }
#if NV_TENSORRT_MAJOR < 11 // the IPluginCreator (V2) methods 11.x removed
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    bool registerCreator(nvinfer1::IPluginCreator&, char const* const) noexcept override
    {
        return false;
    }
    nvinfer1::IPluginCreator* const* getPluginCreatorList(int32_t* const n) const noexcept override
    {
        *n = 0;
        return nullptr;
    }
    nvinfer1::IPluginCreator* getPluginCreator(char const* const, char const* const, char const* const) noexcept override
    {
        return nullptr;
    }
    bool deregisterCreator(nvinfer1::IPluginCreator const&) noexcept override
    {
        return false;
    }
#pragma GCC diagnostic pop
#endif
};

FakeRegistry gRegistry;

} // namespace

extern "C" TENSORRTAPI nvinfer1::IPluginRegistry* getPluginRegistry() noexcept
{
    return &gRegistry;
}

// For the smoke test: the namespace the creator of (name, version, ns) was registered with.
extern "C" TENSORRTAPI char const* fake_registered_namespace(char const* name, char const* version, char const* ns)
{
    auto* c = gRegistry.getCreator(name, version, ns);
    for (auto const& e : gRegistry.entries)
    {
        if (e.creator == c)
        {
            return e.ns.c_str();
        }
    }
    return nullptr;
}
