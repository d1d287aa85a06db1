// Everything the TensorRT plugin decides that is not a TensorRT call: attributes and their plugin
// fields (parsing, validation, serialization), the shape rules, the type and format rules.
// Plain C++17 with no TensorRT or CUDA dependency, so the CPU twin library exports it (C ABI,
// twin/rope_c_api.h) and pytest checks it against rope_export/contract.py.
#pragma once

#include <cstdint>
#include <string>

namespace rope
{

// An op type no TensorRT ONNX importer claims: TensorRT >= 10.15 imports "RotaryEmbedding" with its
// own layer, which would silently replace the plugin when the library is not loaded.
constexpr char const* kPluginName = "RopeExportRotaryEmbedding";
constexpr char const* kPluginVersion = "1";
constexpr char const* kPluginNamespace = "rope_export";

// The op's attributes; int64 so that out-of-range values can be reported rather than wrapped.
struct Attrs
{
    int64_t interleaved = 0;
    int64_t num_heads = 0;
    int64_t rotary_embedding_dim = 0;
};

constexpr int32_t kMaxRank = 8;

struct Dims
{
    int32_t rank = 0;
    int64_t d[kMaxRank] = {};
};

// rope_export.contract.RotaryShape
struct Geometry
{
    int64_t batch = 0, seq = 0, heads = 0, head_dim = 0, rotary_dim = 0;
    int64_t max_pos = -1; // -1: no position_ids (per-token caches)
    bool layout_bhsd = false;
};

// Mirrors rope_export.contract.resolve_shape, with the same checks, order and messages; then adds
// what the kernels need on top (no negative or overflowing sizes). pos == nullptr: no position_ids.
bool resolve_shape(Dims const& x, Dims const& cos, Dims const& sin, Dims const* pos, Attrs const& attrs,
    Geometry& out, std::string& err);

// What resolve_shape can already decide from ranks alone (TensorRT knows ranks, not always sizes,
// when it builds the network). pos_rank < 0: no position_ids. Passing it is necessary, not sufficient.
bool check_ranks(int32_t x_rank, int32_t cos_rank, int32_t sin_rank, int32_t pos_rank, Attrs const& attrs,
    std::string& err);

// Mirrors rope_export.contract.check_dtypes (numpy/torch dtype names). pos == nullptr: no position_ids.
bool check_dtypes(std::string const& x, std::string const& cache, std::string const* pos, std::string& err);

// Plugin fields, as nvinfer1::PluginField carries them (same type codes as nvinfer1::PluginFieldType).
enum class FieldType : int32_t
{
    kFLOAT16 = 0,
    kFLOAT32 = 1,
    kFLOAT64 = 2,
    kINT8 = 3,
    kINT16 = 4,
    kINT32 = 5,
    kCHAR = 6,
    kDIMS = 7,
    kUNKNOWN = 8,
    kBF16 = 9,
    kINT64 = 10,
    kFP8 = 11,
    kINT4 = 12,
    kFP4 = 13,
};

struct Field
{
    char const* name;
    void const* data;
    FieldType type;
    int32_t length;
};

enum class Phase : int32_t
{
    kBuild = 0,   // from the ONNX parser or a user: a missing attribute takes the op's default (0)
    kRuntime = 1, // from a serialized engine: every field must be there
};

constexpr int32_t kNumFields = 3;
extern char const* const kFieldNames[kNumFields]; // interleaved, num_heads, rotary_embedding_dim
// A valid collection names each field once, plus the two routing attributes; anything past this
// bound is a wrong count, refused before a single field is read (a count of 1e9 read past the array).
constexpr int32_t kMaxFieldCount = 16;

// The count and pointer of a field collection, before any field is touched.
bool check_field_count(void const* fields, int32_t count, std::string& err);

// Validates every field (name, type, length, value); ignores plugin_namespace/plugin_version, which
// the ONNX attributes of the trt-plugin lowering carry. Never reads past a field's declared length.
bool parse_fields(Field const* fields, int32_t count, Phase phase, Attrs& out, std::string& err);

// The fields getFieldsToSerialize returns: kINT32 x 1 each, data pointing into `values`. Values that
// parse_fields would refuse (so also any that do not fit INT32) are refused, never narrowed: false,
// err says which, and every value is 0. Attrs that came from parse_fields always serialize.
bool serialize_fields(
    Attrs const& attrs, int32_t (&values)[kNumFields], Field (&fields)[kNumFields], std::string& err);
bool serialize_fields(Attrs const& attrs, int32_t (&values)[kNumFields], Field (&fields)[kNumFields]);

// "interleaved=0 num_heads=32 rotary_embedding_dim=64": getMetadataString and the timing-cache id.
std::string metadata_string(Attrs const& attrs);

// I/O rules of the plugin layer. Tensor dtypes are named like torch/numpy ("float16", "int64", ...).
bool check_io_counts(int32_t nb_inputs, int32_t nb_outputs, std::string& err);
// supportsFormatCombination: decides pos from dtypes/linear of 0..pos only.
bool supports_combination(
    int32_t pos, char const* const* dtypes, bool const* linear, int32_t nb_inputs, int32_t nb_outputs);
// getOutputDataTypes: the output has X's dtype, once the inputs pass the dtype rules.
bool output_dtype(char const* const* input_dtypes, int32_t nb_inputs, int32_t nb_outputs, std::string& out,
    std::string& err);

} // namespace rope
