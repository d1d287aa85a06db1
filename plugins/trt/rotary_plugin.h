// TensorRT IPluginV3 glue of the rotary op: plugin "RopeExportRotaryEmbedding", version "1",
// namespace "rope_export". Every decision that is not a TensorRT call is delegated to the
// TensorRT-free core (core/rope_core.h), which the CPU twin library exports and pytest tests.
// How the creator reaches TensorRT: static_registration.cpp (librope_export_trt_plugin.so) or
// library_entry.cpp (librope_export_trt_vc_plugin.so).
#pragma once

#include "../core/rope_core.h"

#include <NvInferRuntime.h>

#include <string>

namespace rope
{

class RotaryPlugin : public nvinfer1::IPluginV3,
                     public nvinfer1::IPluginV3OneCore,
                     public nvinfer1::IPluginV3OneBuild,
                     public nvinfer1::IPluginV3OneRuntime
{
public:
    explicit RotaryPlugin(Attrs const& attrs);
    RotaryPlugin(RotaryPlugin const& other);
    RotaryPlugin& operator=(RotaryPlugin const&) = delete;
    ~RotaryPlugin() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t getNbOutputs() const noexcept override;
    char const* getTimingCacheID() noexcept override;
    char const* getMetadataString() noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    Attrs mAttrs;
    std::string mMetadata;
    int32_t mNbInputs = 0; // 3 or 4 (with position_ids), known from configurePlugin/onShapeChange
    int32_t mValues[kNumFields] = {};
    nvinfer1::PluginField mFields[kNumFields];
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

class RotaryPluginCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    RotaryPluginCreator();

    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

private:
    nvinfer1::PluginField mFieldNames[kNumFields];
    nvinfer1::PluginFieldCollection mFieldNameCollection{};
};

} // namespace rope
