#include "plugin_log.h"

#include "../core/rope_core.h"

#include <atomic>
#include <cstdio>

namespace rope
{
namespace
{
std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};
std::atomic<nvinfer1::ILogger*> gLogger{nullptr};
} // namespace

void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept
{
    gLoggerFinder.store(finder);
}

void set_logger(nvinfer1::ILogger* logger) noexcept
{
    gLogger.store(logger);
}

void log(nvinfer1::ILogger::Severity severity, std::string const& msg) noexcept
{
    try
    {
        std::string const text = std::string("[") + kPluginNamespace + "::" + kPluginName + "] " + msg;
        nvinfer1::ILoggerFinder* finder = gLoggerFinder.load();
        nvinfer1::ILogger* logger = finder != nullptr ? finder->findLogger() : gLogger.load();
        if (logger != nullptr)
        {
            logger->log(severity, text.c_str());
        }
        else
        {
            std::fprintf(stderr, "%s\n", text.c_str());
        }
    }
    catch (...)
    {
    }
}

} // namespace rope
