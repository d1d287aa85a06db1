#include "rope_core.h"

#include <cstring>
#include <limits>

namespace rope
{

char const* const kFieldNames[kNumFields] = {"interleaved", "num_heads", "rotary_embedding_dim"};

namespace
{

constexpr int64_t kMaxHeadDim = int64_t{1} << 24; // units per token must fit the kernels' int32
constexpr size_t kMaxNameLen = 1024;              // TensorRT's bound on plugin strings

// Python's repr of a list of ints: "[1, 2, 3]".
std::string fmt_dims(Dims const& d)
{
    std::string s = "[";
    for (int32_t i = 0; i < d.rank; ++i)
    {
        s += (i ? ", " : "") + std::to_string(d.d[i]);
    }
    return s + "]";
}

bool same_dims(Dims const& a, Dims const& b)
{
    if (a.rank != b.rank)
    {
        return false;
    }
    for (int32_t i = 0; i < a.rank; ++i)
    {
        if (a.d[i] != b.d[i])
        {
            return false;
        }
    }
    return true;
}

bool fail(std::string& err, std::string msg)
{
    err = std::move(msg);
    return false;
}

// a * b, or false on int64 overflow.
bool mul(int64_t a, int64_t b, int64_t& out)
{
    return !__builtin_mul_overflow(a, b, &out);
}

} // namespace

bool resolve_shape(Dims const& x, Dims const& cos, Dims const& sin, Dims const* pos, Attrs const& attrs,
    Geometry& out, std::string& err)
{
    for (Dims const* d : {&x, &cos, &sin, pos})
    {
        if (d == nullptr)
        {
            continue;
        }
        if (d->rank < 0 || d->rank > kMaxRank)
        {
            return fail(err, "tensor rank " + std::to_string(d->rank) + " is outside [0, 8]");
        }
        for (int32_t i = 0; i < d->rank; ++i)
        {
            if (d->d[i] < 0)
            {
                return fail(err, "shape " + fmt_dims(*d) + " has a negative or unknown dimension; "
                                 "the shapes must be concrete here");
            }
        }
    }
    // From here on: rope_export.contract.resolve_shape, check for check and message for message.
    if (attrs.num_heads < 0 || attrs.rotary_embedding_dim < 0)
    {
        return fail(err, "num_heads (" + std::to_string(attrs.num_heads) + ") and rotary_embedding_dim ("
                + std::to_string(attrs.rotary_embedding_dim)
                + ") must be >= 0 (0 means: infer from X / rotate the whole head)");
    }
    Geometry g;
    if (x.rank == 4)
    {
        g.batch = x.d[0];
        g.heads = x.d[1];
        g.seq = x.d[2];
        g.head_dim = x.d[3];
        if (attrs.num_heads && attrs.num_heads != g.heads)
        {
            return fail(err, "num_heads=" + std::to_string(attrs.num_heads) + " but 4-D X [B, H, S, D] has H="
                    + std::to_string(g.heads) + "; set num_heads to 0 or to H");
        }
        g.layout_bhsd = true;
    }
    else if (x.rank == 3)
    {
        g.batch = x.d[0];
        g.seq = x.d[1];
        int64_t const hidden = x.d[2];
        if (attrs.num_heads <= 0)
        {
            return fail(err, "3-D X [B, S, H*D] needs the num_heads attribute; pass num_heads=H or give X as "
                             "[B, H, S, D]");
        }
        if (hidden % attrs.num_heads)
        {
            return fail(err, "3-D X has hidden size " + std::to_string(hidden) + ", not a multiple of num_heads="
                    + std::to_string(attrs.num_heads));
        }
        g.heads = attrs.num_heads;
        g.head_dim = hidden / attrs.num_heads;
        g.layout_bhsd = false;
    }
    else
    {
        return fail(err, "X must be 4-D [B, H, S, D] or 3-D [B, S, H*D], got shape " + fmt_dims(x));
    }
    g.rotary_dim = attrs.rotary_embedding_dim ? attrs.rotary_embedding_dim : g.head_dim;
    if (g.rotary_dim > g.head_dim)
    {
        return fail(err, "rotary_embedding_dim=" + std::to_string(g.rotary_dim) + " is larger than head_dim="
                + std::to_string(g.head_dim) + "; use a value <= head_dim (0 rotates the whole head)");
    }
    if (g.rotary_dim % 2)
    {
        return fail(err, "the rotated dimension must be even (channels rotate in pairs), got "
                + std::to_string(g.rotary_dim) + "; use an even head_dim or rotary_embedding_dim");
    }
    int64_t const half = g.rotary_dim / 2;
    if (!same_dims(cos, sin))
    {
        return fail(err, "cos_cache " + fmt_dims(cos) + " and sin_cache " + fmt_dims(sin) + " must have the same shape");
    }
    if (pos != nullptr)
    {
        if (pos->rank != 2 || pos->d[0] != g.batch || pos->d[1] != g.seq)
        {
            return fail(err, "position_ids must be [B, S] = [" + std::to_string(g.batch) + ", " + std::to_string(g.seq)
                    + "], got " + fmt_dims(*pos));
        }
        if (cos.rank != 2 || cos.d[1] != half)
        {
            return fail(err, "with position_ids the caches must be [max_pos, rotary_dim/2] = [max_pos, "
                    + std::to_string(half) + "], got " + fmt_dims(cos));
        }
        g.max_pos = cos.d[0];
        if (g.max_pos < 1)
        {
            return fail(err, "the caches have no rows (max_pos = 0)");
        }
    }
    else
    {
        if (cos.rank != 3 || cos.d[0] != g.batch || cos.d[1] != g.seq || cos.d[2] != half)
        {
            return fail(err, "without position_ids the caches must be per token, [B, S, rotary_dim/2] = ["
                    + std::to_string(g.batch) + ", " + std::to_string(g.seq) + ", " + std::to_string(half)
                    + "], got " + fmt_dims(cos)
                    + "; pass position_ids to gather from a [max_pos, rotary_dim/2] cache");
        }
        g.max_pos = -1;
    }
    // Beyond the Python contract: limits of the kernels (int64 element counts, int32 units per head).
    int64_t n = 0;
    if (!mul(g.batch, g.seq, n) || !mul(n, g.heads, n) || !mul(n, g.head_dim, n) || !mul(n, 8, n))
    {
        return fail(err, "X " + fmt_dims(x) + " has too many elements for 64-bit byte offsets");
    }
    if (g.head_dim > kMaxHeadDim)
    {
        return fail(err, "head_dim=" + std::to_string(g.head_dim) + " is larger than the kernels support ("
                + std::to_string(kMaxHeadDim) + ")");
    }
    out = g;
    return true;
}

bool check_ranks(int32_t x_rank, int32_t cos_rank, int32_t sin_rank, int32_t pos_rank, Attrs const& attrs,
    std::string& err)
{
    auto rank = [](int32_t r) { return "a rank-" + std::to_string(r) + " tensor"; };
    if (attrs.num_heads < 0 || attrs.rotary_embedding_dim < 0)
    {
        return fail(err, "num_heads (" + std::to_string(attrs.num_heads) + ") and rotary_embedding_dim ("
                + std::to_string(attrs.rotary_embedding_dim)
                + ") must be >= 0 (0 means: infer from X / rotate the whole head)");
    }
    if (x_rank != 3 && x_rank != 4)
    {
        return fail(err, "X must be 4-D [B, H, S, D] or 3-D [B, S, H*D], got " + rank(x_rank));
    }
    if (x_rank == 3 && attrs.num_heads <= 0)
    {
        return fail(err, "3-D X [B, S, H*D] needs the num_heads attribute; pass num_heads=H or give X as "
                         "[B, H, S, D]");
    }
    if (cos_rank != sin_rank)
    {
        return fail(err, "cos_cache (" + rank(cos_rank) + ") and sin_cache (" + rank(sin_rank)
                + ") must have the same shape");
    }
    if (pos_rank >= 0 && pos_rank != 2)
    {
        return fail(err, "position_ids must be [B, S], got " + rank(pos_rank));
    }
    if (pos_rank >= 0 && cos_rank != 2)
    {
        return fail(err, "with position_ids the caches must be [max_pos, rotary_dim/2], got " + rank(cos_rank));
    }
    if (pos_rank < 0 && cos_rank != 3)
    {
        return fail(err, "without position_ids the caches must be per token, [B, S, rotary_dim/2], got "
                + rank(cos_rank) + "; pass position_ids to gather from a [max_pos, rotary_dim/2] cache");
    }
    return true;
}

bool check_dtypes(std::string const& x, std::string const& cache, std::string const* pos, std::string& err)
{
    if (x != "float32" && x != "float16" && x != "bfloat16")
    {
        return fail(err, "X must be one of ('float32', 'float16', 'bfloat16'), got " + x);
    }
    if (cache != x && cache != "float32")
    {
        return fail(err, "the caches must have X's dtype (" + x + ") or float32, got " + cache);
    }
    if (pos != nullptr && *pos != "int64")
    {
        return fail(err, "position_ids must be int64, got " + *pos + "; cast them with .long()");
    }
    return true;
}

namespace
{

char const* field_type_name(FieldType t)
{
    switch (t)
    {
    case FieldType::kFLOAT16: return "FLOAT16";
    case FieldType::kFLOAT32: return "FLOAT32";
    case FieldType::kFLOAT64: return "FLOAT64";
    case FieldType::kINT8: return "INT8";
    case FieldType::kINT16: return "INT16";
    case FieldType::kINT32: return "INT32";
    case FieldType::kCHAR: return "CHAR";
    case FieldType::kDIMS: return "DIMS";
    case FieldType::kUNKNOWN: return "UNKNOWN";
    case FieldType::kBF16: return "BF16";
    case FieldType::kINT64: return "INT64";
    case FieldType::kFP8: return "FP8";
    case FieldType::kINT4: return "INT4";
    case FieldType::kFP4: return "FP4";
    }
    return "an invalid type code";
}

// A field name fit for a message: bounded, printable.
std::string printable(char const* name, size_t len)
{
    std::string s;
    for (size_t i = 0; i < len && i < 64; ++i)
    {
        char const c = name[i];
        s += (c >= 0x20 && c < 0x7f) ? c : '?';
    }
    return len > 64 ? s + "..." : s;
}

// The range rule of field k (kFieldNames order), shared by parsing and serialization; the message
// says what the value must be (the caller prefixes the field).
bool check_field_value(int32_t k, int64_t v, std::string& err)
{
    if (k == 0 && v != 0 && v != 1)
    {
        return fail(err, "must be 0 (rotate-half) or 1 (interleaved), got " + std::to_string(v));
    }
    if (k == 1 && (v < 0 || v > std::numeric_limits<int32_t>::max()))
    {
        return fail(err, "must be in [0, 2147483647] (0: take H from 4-D X), got " + std::to_string(v));
    }
    if (k == 2 && (v < 0 || v > std::numeric_limits<int32_t>::max()))
    {
        return fail(err, "must be in [0, 2147483647] (0: rotate the whole head), got " + std::to_string(v));
    }
    if (k == 2 && v % 2)
    {
        return fail(err, "must be even (channels rotate in pairs), got " + std::to_string(v));
    }
    return true;
}

} // namespace

bool check_field_count(void const* fields, int32_t count, std::string& err)
{
    std::string const where = "RotaryEmbedding plugin: ";
    if (count < 0 || (count > 0 && fields == nullptr))
    {
        return fail(err, where + "malformed field collection (" + std::to_string(count) + " fields at "
                + (fields ? "a valid pointer" : "a null pointer") + ")");
    }
    if (count > kMaxFieldCount)
    {
        return fail(err, where + "malformed field collection (" + std::to_string(count) + " fields; at most "
                + std::to_string(kMaxFieldCount) + ": the op has 3, plus plugin_namespace and plugin_version)");
    }
    return true;
}

bool parse_fields(Field const* fields, int32_t count, Phase phase, Attrs& out, std::string& err)
{
    std::string const where = "RotaryEmbedding plugin: ";
    if (!check_field_count(fields, count, err))
    {
        return false;
    }
    int64_t values[kNumFields] = {0, 0, 0};
    bool seen[kNumFields] = {false, false, false};
    for (int32_t i = 0; i < count; ++i)
    {
        Field const& f = fields[i];
        if (f.name == nullptr)
        {
            return fail(err, where + "field #" + std::to_string(i) + " has no name");
        }
        size_t const len = strnlen(f.name, kMaxNameLen + 1);
        if (len > kMaxNameLen)
        {
            return fail(err, where + "field #" + std::to_string(i) + " has a name longer than 1024 bytes");
        }
        std::string const name(f.name, len);
        if (name == "plugin_namespace" || name == "plugin_version")
        {
            continue; // routing attributes of the ONNX node, not op attributes
        }
        int32_t k = 0;
        while (k < kNumFields && name != kFieldNames[k])
        {
            ++k;
        }
        if (k == kNumFields)
        {
            return fail(err, where + "unknown field '" + printable(f.name, len)
                    + "'; the fields are interleaved, num_heads and rotary_embedding_dim");
        }
        std::string const field = where + "field '" + name + "' ";
        if (seen[k])
        {
            return fail(err, field + "is given more than once");
        }
        seen[k] = true;
        if (f.type != FieldType::kINT32 && f.type != FieldType::kINT64)
        {
            return fail(err, field + "must be INT32 (or INT64), got " + field_type_name(f.type));
        }
        if (f.length != 1)
        {
            return fail(err, field + "must hold exactly 1 value, got " + std::to_string(f.length));
        }
        if (f.data == nullptr)
        {
            return fail(err, field + "has no data");
        }
        int64_t v = 0;
        if (f.type == FieldType::kINT32)
        {
            int32_t v32 = 0;
            std::memcpy(&v32, f.data, sizeof v32); // the data may be unaligned
            v = v32;
        }
        else
        {
            std::memcpy(&v, f.data, sizeof v);
        }
        if (!check_field_value(k, v, err))
        {
            err = field + err;
            return false;
        }
        values[k] = v;
    }
    if (phase == Phase::kRuntime)
    {
        for (int32_t k = 0; k < kNumFields; ++k)
        {
            if (!seen[k])
            {
                return fail(err, where + "the serialized plugin lacks field '" + kFieldNames[k]
                        + "': the engine is damaged or was built by another plugin version; rebuild the engine");
            }
        }
    }
    out.interleaved = values[0];
    out.num_heads = values[1];
    out.rotary_embedding_dim = values[2];
    return true;
}

bool serialize_fields(
    Attrs const& attrs, int32_t (&values)[kNumFields], Field (&fields)[kNumFields], std::string& err)
{
    int64_t const in[kNumFields] = {attrs.interleaved, attrs.num_heads, attrs.rotary_embedding_dim};
    for (int32_t k = 0; k < kNumFields; ++k)
    {
        values[k] = 0;
        fields[k] = Field{kFieldNames[k], &values[k], FieldType::kINT32, 1};
    }
    for (int32_t k = 0; k < kNumFields; ++k)
    {
        // Values parse_fields would refuse are refused here too: an INT32 field never narrows.
        if (!check_field_value(k, in[k], err))
        {
            err = "RotaryEmbedding plugin: cannot serialize field '" + std::string(kFieldNames[k]) + "': " + err;
            return false;
        }
    }
    for (int32_t k = 0; k < kNumFields; ++k)
    {
        values[k] = static_cast<int32_t>(in[k]);
    }
    return true;
}

bool serialize_fields(Attrs const& attrs, int32_t (&values)[kNumFields], Field (&fields)[kNumFields])
{
    std::string err;
    return serialize_fields(attrs, values, fields, err);
}

std::string metadata_string(Attrs const& attrs)
{
    return "interleaved=" + std::to_string(attrs.interleaved) + " num_heads=" + std::to_string(attrs.num_heads)
        + " rotary_embedding_dim=" + std::to_string(attrs.rotary_embedding_dim);
}

bool check_io_counts(int32_t nb_inputs, int32_t nb_outputs, std::string& err)
{
    if ((nb_inputs != 3 && nb_inputs != 4) || nb_outputs != 1)
    {
        return fail(err, "RotaryEmbedding takes 3 inputs (X, cos_cache, sin_cache) or 4 (and position_ids) and "
                         "gives 1 output, got "
                + std::to_string(nb_inputs) + " inputs and " + std::to_string(nb_outputs) + " outputs");
    }
    return true;
}

bool supports_combination(
    int32_t pos, char const* const* dtypes, bool const* linear, int32_t nb_inputs, int32_t nb_outputs)
{
    std::string err;
    if (!check_io_counts(nb_inputs, nb_outputs, err) || pos < 0 || pos >= nb_inputs + nb_outputs
        || dtypes == nullptr || linear == nullptr || dtypes[pos] == nullptr || !linear[pos])
    {
        return false;
    }
    std::string const t = dtypes[pos];
    if (pos == 0)
    {
        return t == "float32" || t == "float16" || t == "bfloat16";
    }
    std::string const x = dtypes[0] ? dtypes[0] : "";
    switch (pos)
    {
    case 1: return t == x || t == "float32";
    case 2: return dtypes[1] != nullptr && t == dtypes[1];
    case 3:
        if (nb_inputs == 4)
        {
            return t == "int64";
        }
        return t == x; // the output, when there are no position_ids
    default: return t == x;
    }
}

bool output_dtype(char const* const* input_dtypes, int32_t nb_inputs, int32_t nb_outputs, std::string& out,
    std::string& err)
{
    if (!check_io_counts(nb_inputs, nb_outputs, err))
    {
        return false;
    }
    std::string names[4];
    for (int32_t i = 0; i < nb_inputs; ++i)
    {
        names[i] = (input_dtypes && input_dtypes[i]) ? input_dtypes[i] : "an unknown dtype";
    }
    if (names[1] != names[2])
    {
        return fail(err, "cos_cache (" + names[1] + ") and sin_cache (" + names[2] + ") must have the same dtype");
    }
    if (!check_dtypes(names[0], names[1], nb_inputs == 4 ? &names[3] : nullptr, err))
    {
        return false;
    }
    out = names[0];
    return true;
}

} // namespace rope
