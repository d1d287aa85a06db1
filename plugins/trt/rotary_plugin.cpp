#include "rotary_plugin.h"

#include "plugin_log.h"
#include "../rotary/rotary_cuda.h"
#include "../rotary/rotary_problem.h"

#include <cstring>
#include <exception>
#include <vector>

using nvinfer1::DataType;
using nvinfer1::PluginFieldType;

namespace rope
{
namespace
{

static_assert(static_cast<int32_t>(PluginFieldType::kINT32) == static_cast<int32_t>(FieldType::kINT32)
        && static_cast<int32_t>(PluginFieldType::kINT64) == static_cast<int32_t>(FieldType::kINT64)
        && static_cast<int32_t>(PluginFieldType::kCHAR) == static_cast<int32_t>(FieldType::kCHAR)
        && static_cast<int32_t>(PluginFieldType::kFLOAT32) == static_cast<int32_t>(FieldType::kFLOAT32),
    "core/rope_core.h FieldType must use nvinfer1::PluginFieldType's codes");

void error(std::string const& msg) noexcept
{
    log_error(msg);
}

// Refuses, when the plugin is configured, a GPU this build has no kernels for (rather than
// failing at the first enqueue with "no kernel image").
bool check_device() noexcept
{
    try
    {
        std::string err;
        if (device_supported(err))
        {
            return true;
        }
        error(err);
    }
    catch (...)
    {
    }
    return false;
}

// The core names dtypes like torch does.
char const* dtype_name(DataType t) noexcept
{
    switch (t)
    {
    case DataType::kFLOAT: return "float32";
    case DataType::kHALF: return "float16";
    case DataType::kBF16: return "bfloat16";
    case DataType::kINT64: return "int64";
    case DataType::kINT32: return "int32";
    case DataType::kINT8: return "int8";
    case DataType::kUINT8: return "uint8";
    case DataType::kBOOL: return "bool";
    case DataType::kFP8: return "float8_e4m3fn";
    default: return "a TensorRT type the plugin does not take";
    }
}

Dims to_dims(nvinfer1::Dims const& d) noexcept
{
    Dims out;
    out.rank = d.nbDims;
    for (int32_t i = 0; i < d.nbDims && i < kMaxRank; ++i)
    {
        out.d[i] = d.d[i];
    }
    return out;
}

// Shapes and dtypes of one concrete call, checked against the op contract.
bool resolve(Attrs const& attrs, nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, int32_t nbOutputs,
    Geometry& g, StorageType& x_type, StorageType& cache_type, std::string& err)
{
    if (!check_io_counts(nbInputs, nbOutputs, err))
    {
        return false;
    }
    Dims const pos = nbInputs == 4 ? to_dims(in[3].dims) : Dims{};
    if (!resolve_shape(to_dims(in[0].dims), to_dims(in[1].dims), to_dims(in[2].dims), nbInputs == 4 ? &pos : nullptr,
            attrs, g, err))
    {
        return false;
    }
    char const* names[4] = {};
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        names[i] = dtype_name(in[i].type);
    }
    std::string out_type;
    if (!output_dtype(names, nbInputs, nbOutputs, out_type, err))
    {
        return false;
    }
    return storage_type(names[0], x_type) && storage_type(names[1], cache_type);
}

} // namespace

// --- RotaryPlugin ---------------------------------------------------------------------------------

RotaryPlugin::RotaryPlugin(Attrs const& attrs)
    : mAttrs(attrs)
    , mMetadata(metadata_string(attrs))
{
}

RotaryPlugin::RotaryPlugin(RotaryPlugin const& other)
    : RotaryPlugin(other.mAttrs)
{
    mNbInputs = other.mNbInputs;
}

nvinfer1::IPluginCapability* RotaryPlugin::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    }
    return nullptr;
}

nvinfer1::IPluginV3* RotaryPlugin::clone() noexcept
{
    try
    {
        return new RotaryPlugin(*this);
    }
    catch (std::exception const& e)
    {
        error(std::string("clone failed: ") + e.what());
    }
    return nullptr;
}

char const* RotaryPlugin::getPluginName() const noexcept
{
    return kPluginName;
}

char const* RotaryPlugin::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* RotaryPlugin::getPluginNamespace() const noexcept
{
    return kPluginNamespace;
}

int32_t RotaryPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        std::string err;
        if (!check_io_counts(nbInputs, nbOutputs, err))
        {
            error(err);
            return -1;
        }
        char const* names[4] = {};
        for (int32_t i = 0; i < nbInputs; ++i)
        {
            names[i] = dtype_name(in[i].desc.type);
        }
        std::string out_type;
        if (!output_dtype(names, nbInputs, nbOutputs, out_type, err)
            || !check_ranks(in[0].desc.dims.nbDims, in[1].desc.dims.nbDims, in[2].desc.dims.nbDims,
                nbInputs == 4 ? in[3].desc.dims.nbDims : -1, mAttrs, err))
        {
            error(err);
            return -1;
        }
        if (out[0].desc.type != in[0].desc.type)
        {
            error("the output must have X's dtype");
            return -1;
        }
        if (!check_device())
        {
            return -1;
        }
        mNbInputs = nbInputs;
        return 0;
    }
    catch (std::exception const& e)
    {
        error(std::string("configurePlugin failed: ") + e.what());
    }
    return -1;
}

int32_t RotaryPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    try
    {
        std::string err;
        if (!check_io_counts(nbInputs, nbOutputs, err))
        {
            error(err);
            return -1;
        }
        char const* names[4] = {};
        for (int32_t i = 0; i < nbInputs; ++i)
        {
            names[i] = dtype_name(inputTypes[i]);
        }
        std::string out_type;
        if (!output_dtype(names, nbInputs, nbOutputs, out_type, err))
        {
            error(err);
            return -1;
        }
        outputTypes[0] = inputTypes[0];
        return 0;
    }
    catch (std::exception const& e)
    {
        error(std::string("getOutputDataTypes failed: ") + e.what());
    }
    return -1;
}

int32_t RotaryPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /* shapeInputs */, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /* exprBuilder */) noexcept
{
    try
    {
        std::string err;
        if (!check_io_counts(nbInputs, nbOutputs, err)
            || !check_ranks(inputs[0].nbDims, inputs[1].nbDims, inputs[2].nbDims, nbInputs == 4 ? inputs[3].nbDims : -1,
                mAttrs, err))
        {
            error(err);
            return -1;
        }
        if (nbShapeInputs != 0)
        {
            error(std::string(kPluginName) + " takes no shape inputs");
            return -1;
        }
        outputs[0] = inputs[0]; // Y has X's shape
        return 0;
    }
    catch (std::exception const& e)
    {
        error(std::string("getOutputShapes failed: ") + e.what());
    }
    return -1;
}

bool RotaryPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    std::string err;
    if (!check_io_counts(nbInputs, nbOutputs, err) || pos < 0 || pos >= nbInputs + nbOutputs)
    {
        return false;
    }
    // Only inOut[0..pos] are meaningful here (TensorRT's contract), and only those are read.
    char const* names[5] = {};
    bool linear[5] = {};
    for (int32_t i = 0; i <= pos; ++i)
    {
        names[i] = dtype_name(inOut[i].desc.type);
        linear[i] = inOut[i].desc.format == nvinfer1::TensorFormat::kLINEAR;
    }
    return supports_combination(pos, names, linear, nbInputs, nbOutputs);
}

int32_t RotaryPlugin::getNbOutputs() const noexcept
{
    return 1;
}

char const* RotaryPlugin::getTimingCacheID() noexcept
{
    return mMetadata.c_str(); // the attributes are all that sets the kernel apart beyond shapes and types
}

char const* RotaryPlugin::getMetadataString() noexcept
{
    return mMetadata.c_str();
}

int32_t RotaryPlugin::onShapeChange(
    nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        Geometry g;
        StorageType x_type{};
        StorageType cache_type{};
        std::string err;
        if (!resolve(mAttrs, in, nbInputs, nbOutputs, g, x_type, cache_type, err))
        {
            error(err);
            return -1;
        }
        if (out[0].type != in[0].type)
        {
            error("the output must have X's dtype");
            return -1;
        }
        if (!check_device())
        {
            return -1;
        }
        mNbInputs = nbInputs;
        return 0;
    }
    catch (std::exception const& e)
    {
        error(std::string("onShapeChange failed: ") + e.what());
    }
    return -1;
}

int32_t RotaryPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* /* out */,
    void const* const* inputs, void* const* outputs, void* /* workspace */, cudaStream_t stream) noexcept
{
    try
    {
        Geometry g;
        StorageType x_type{};
        StorageType cache_type{};
        std::string err;
        // Re-checked on every call: cheap host work, and no launch can then read past a buffer.
        if (!resolve(mAttrs, inputDesc, mNbInputs, 1, g, x_type, cache_type, err))
        {
            error("enqueue: " + err);
            return -1;
        }
        Problem const p = make_problem(g, mAttrs.interleaved != 0, x_type, cache_type, inputs[0], inputs[1], inputs[2],
            mNbInputs == 4 ? static_cast<int64_t const*>(inputs[3]) : nullptr, outputs[0]);
        cudaError_t const rc = launch_cuda(p, false, stream);
        if (rc != cudaSuccess)
        {
            error(std::string("kernel launch failed: ") + cudaGetErrorString(rc));
            return -1;
        }
        return 0;
    }
    catch (std::exception const& e)
    {
        error(std::string("enqueue failed: ") + e.what());
    }
    return -1;
}

nvinfer1::IPluginV3* RotaryPlugin::attachToContext(nvinfer1::IPluginResourceContext* /* context */) noexcept
{
    return clone(); // no per-context resources
}

nvinfer1::PluginFieldCollection const* RotaryPlugin::getFieldsToSerialize() noexcept
{
    Field fields[kNumFields];
    std::string err;
    if (!serialize_fields(mAttrs, mValues, fields, err)) // cannot happen for attributes parse_fields accepted
    {
        error("getFieldsToSerialize: " + err);
        return nullptr;
    }
    for (int32_t k = 0; k < kNumFields; ++k)
    {
        mFields[k] = nvinfer1::PluginField(
            fields[k].name, fields[k].data, static_cast<PluginFieldType>(fields[k].type), fields[k].length);
    }
    mFieldCollection.nbFields = kNumFields;
    mFieldCollection.fields = mFields;
    return &mFieldCollection;
}

// --- RotaryPluginCreator --------------------------------------------------------------------------

RotaryPluginCreator::RotaryPluginCreator()
{
    for (int32_t k = 0; k < kNumFields; ++k)
    {
        mFieldNames[k] = nvinfer1::PluginField(kFieldNames[k], nullptr, PluginFieldType::kINT32, 1);
    }
    mFieldNameCollection.nbFields = kNumFields;
    mFieldNameCollection.fields = mFieldNames;
}

nvinfer1::IPluginV3* RotaryPluginCreator::createPlugin(
    char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept
{
    try
    {
        int32_t const count = fc != nullptr ? fc->nbFields : 0;
        std::vector<Field> fields;
        Field const* first = nullptr;
        if (count > 0 && fc->fields != nullptr)
        {
            fields.reserve(static_cast<size_t>(count));
            for (int32_t i = 0; i < count; ++i)
            {
                nvinfer1::PluginField const& f = fc->fields[i];
                fields.push_back(Field{f.name, f.data, static_cast<FieldType>(f.type), f.length});
            }
            first = fields.data();
        }
        Attrs attrs;
        std::string err;
        Phase const p = phase == nvinfer1::TensorRTPhase::kRUNTIME ? Phase::kRuntime : Phase::kBuild;
        if (!parse_fields(first, count, p, attrs, err))
        {
            std::string const layer = name != nullptr ? std::string(name, strnlen(name, 256)) : std::string("?");
            error("cannot create the plugin of layer '" + layer + "': " + err);
            return nullptr;
        }
        return new RotaryPlugin(attrs);
    }
    catch (std::exception const& e)
    {
        error(std::string("createPlugin failed: ") + e.what());
    }
    return nullptr;
}

nvinfer1::PluginFieldCollection const* RotaryPluginCreator::getFieldNames() noexcept
{
    return &mFieldNameCollection;
}

char const* RotaryPluginCreator::getPluginName() const noexcept
{
    return kPluginName;
}

char const* RotaryPluginCreator::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* RotaryPluginCreator::getPluginNamespace() const noexcept
{
    return kPluginNamespace;
}

} // namespace rope
