// torchrun-style environment for the examples: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and
// (optional) PIPESGD_JOB_TOKEN, as scripts/install_check.sh or `pipesgd run` set them.
#pragma once
#include <cstdlib>
#include <stdexcept>
#include <string>

#include <pipesgd/pipesgd.h>

inline pipesgd::ConnectOptions ConnectFromEnv() {
  auto get = [](const char* name, const char* fallback) -> std::string {
    const char* v = std::getenv(name);
    if (v != nullptr) return v;
    if (fallback != nullptr) return fallback;
    throw std::runtime_error(std::string("environment variable ") + name + " is not set");
  };
  pipesgd::ConnectOptions o;
  o.master_addr = get("MASTER_ADDR", "127.0.0.1");
  o.master_port = static_cast<uint16_t>(std::stoi(get("MASTER_PORT", nullptr)));
  o.rank = std::stoi(get("RANK", nullptr));
  o.world_size = std::stoi(get("WORLD_SIZE", nullptr));
  o.token = get("PIPESGD_JOB_TOKEN", "");
  o.timeout_s = 30;
  return o;
}
