// The twin's export of core/device_support.h, so pytest can read the kernels' refusal message.
#include "rope_c_api.h"

#include "../core/device_support.h"

#include <cstring>

extern "C" int32_t rope_no_kernel_image_message(
    char const* device_name, int32_t major, int32_t minor, char const* built_archs, char* out, int64_t out_len)
{
    std::string const msg
        = rope::no_kernel_image_message(device_name ? device_name : "", major, minor, built_archs ? built_archs : "");
    if (out == nullptr || out_len <= static_cast<int64_t>(msg.size()))
    {
        return 1;
    }
    std::memcpy(out, msg.c_str(), msg.size() + 1);
    return 0;
}
