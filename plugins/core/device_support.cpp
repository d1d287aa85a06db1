#include "device_support.h"

namespace rope
{

std::string no_kernel_image_message(
    std::string const& device_name, int major, int minor, std::string const& built_archs)
{
    std::string const sm = std::to_string(major) + std::to_string(minor);
    std::string archs;
    std::string newest;
    size_t start = 0;
    while (start <= built_archs.size())
    {
        size_t const end = built_archs.find(',', start);
        std::string const a = built_archs.substr(start, end == std::string::npos ? std::string::npos : end - start);
        if (!a.empty())
        {
            archs += (archs.empty() ? "sm_" : ", sm_") + a;
            newest = a;
        }
        if (end == std::string::npos)
        {
            break;
        }
        start = end + 1;
    }
    return "the rope_export kernels were not built for " + device_name + " (sm_" + sm + "): this build has "
        + (archs.empty() ? std::string("no architectures") : archs + " and PTX of compute_" + newest)
        + "; rebuild with `rope-export build-plugin --cuda-archs \"" + (built_archs.empty() ? sm : built_archs) + ","
        + sm + "\"` (CMake: -DROPE_EXPORT_CUDA_ARCHS=\"...;" + sm + "\")";
}

} // namespace rope
