#include "core/base/log.h"

#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include <cstdio>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/base_sink.h>

namespace pipesgd {
namespace {

std::mutex g_prefix_mu;
std::string g_line_prefix;  // SetLogLinePrefix

// %* prints "warning: "/"error: " for those levels and nothing for info, so metric lines stay
// clean while problems stand out.
class LevelPrefix : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    std::string_view prefix;
    switch (msg.level) {
      case spdlog::level::trace: prefix = "trace: "; break;
      case spdlog::level::debug: prefix = "debug: "; break;
      case spdlog::level::warn: prefix = "warning: "; break;
      case spdlog::level::err: prefix = "error: "; break;
      case spdlog::level::critical: prefix = "fatal: "; break;
      default: break;
    }
    {
      std::lock_guard<std::mutex> lock(g_prefix_mu);
      dest.append(g_line_prefix.data(), g_line_prefix.data() + g_line_prefix.size());
    }
    dest.append(prefix.data(), prefix.data() + prefix.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<LevelPrefix>();
  }
};

// Info and debug to stdout, warnings and errors to stderr, so that `2>errors.txt` captures what
// went wrong and pipelines of stdout stay clean. Both are flushed per line.
class SplitSink : public spdlog::sinks::base_sink<std::mutex> {
 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    std::FILE* out = msg.level >= spdlog::level::warn ? stderr : stdout;
    if (out == stderr) std::fflush(stdout);  // keep the two streams in order on a terminal
    std::fwrite(formatted.data(), 1, formatted.size(), out);
    std::fflush(out);
  }
  void flush_() override {
    std::fflush(stdout);
    std::fflush(stderr);
  }
};

}  // namespace

void InitLogging(bool verbose) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  auto logger = spdlog::get("pipesgd");
  if (!logger) {
    logger = std::make_shared<spdlog::logger>("pipesgd", std::make_shared<SplitSink>());
    spdlog::register_logger(logger);
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<LevelPrefix>('*').set_pattern("%*%v");
    logger->set_formatter(std::move(formatter));
    logger->flush_on(spdlog::level::trace);
    spdlog::set_default_logger(logger);
  }
  logger->set_level(verbose ? spdlog::level::debug : spdlog::level::info);
}

void SetLogLinePrefix(std::string prefix) {
  std::lock_guard<std::mutex> lock(g_prefix_mu);
  g_line_prefix = std::move(prefix);
}

}  // namespace pipesgd
