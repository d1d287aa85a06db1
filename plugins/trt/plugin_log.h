// Where the plugin's messages go: TensorRT's logger once the library's entry point found one
// (setLoggerFinder for loadLibrary hosts, getLogger of the runtime it registered with otherwise),
// else stderr.
#pragma once

#include <NvInferRuntime.h>

#include <string>

namespace rope
{

void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept;
void set_logger(nvinfer1::ILogger* logger) noexcept;
void log(nvinfer1::ILogger::Severity severity, std::string const& msg) noexcept;

inline void log_error(std::string const& msg) noexcept
{
    log(nvinfer1::ILogger::Severity::kERROR, msg);
}

} // namespace rope
