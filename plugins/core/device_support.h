// Which GPUs a build of the kernels can run on, and the message when it cannot: TensorRT-free and
// CUDA-free, so the CPU twin exports it and pytest checks it.
#pragma once

#include <string>

namespace rope
{

// The refusal for a device the build has no kernel image for. built_archs: the SM numbers the
// kernels were compiled for, comma-separated ("75,80,86"); the newest also as PTX.
std::string no_kernel_image_message(
    std::string const& device_name, int major, int minor, std::string const& built_archs);

} // namespace rope
