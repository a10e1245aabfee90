#include "launcher/hostfile.h"

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/base/error.h"

namespace pipesgd::launcher {
namespace {

constexpr int kMaxSlots = 4096;

// An ssh destination: [user@]host, letters, digits, '.', '-', '_'; never starting with '-' (ssh
// would take it for an option).
std::string CheckHost(std::string_view host, const std::string& where) {
  if (host.empty()) Throw(ErrorCode::kInvalidArgument, "{}: empty host name", where);
  if (host.front() == '-') {
    Throw(ErrorCode::kInvalidArgument, "{}: host '{}' starts with '-'", where, host);
  }
  int ats = 0;
  for (char c : host) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '-' || c == '_' || c == '@';
    ats += c == '@';
    if (!ok || ats > 1) {
      Throw(ErrorCode::kInvalidArgument,
            "{}: host '{}': expected [user@]name with letters, digits, '.', '-', '_' (IPv6 "
            "addresses: use a name from your ssh config)",
            where, host);
    }
  }
  return std::string(host);
}

int ParseSlots(std::string_view text, const std::string& where, std::string_view what) {
  int value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || value < 1 ||
      value > kMaxSlots) {
    Throw(ErrorCode::kInvalidArgument, "{}: {}: expected an integer in [1, {}]", where, what,
          kMaxSlots);
  }
  return value;
}

// Adds `slots` to `host`, or appends it: a host named twice gets the sum, in first-seen order.
void Add(std::vector<HostSlots>* hosts, const std::string& host, int slots) {
  for (auto& h : *hosts) {
    if (h.host == host) {
      h.slots += slots;
      return;
    }
  }
  hosts->push_back({host, slots});
}

std::string Describe(const std::vector<HostSlots>& hosts) {
  std::vector<std::string> parts;
  for (const auto& h : hosts) parts.push_back(fmt::format("{}:{}", h.host, h.slots));
  return fmt::format("{}", fmt::join(parts, ", "));
}

}  // namespace

std::vector<HostSlots> ParseHostList(std::string_view spec) {
  std::vector<HostSlots> hosts;
  const std::string where = fmt::format("-H {}", spec);
  if (spec.empty()) Throw(ErrorCode::kInvalidArgument, "-H: empty host list");
  size_t start = 0;
  while (true) {
    const size_t comma = spec.find(',', start);
    const std::string_view entry = spec.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    if (entry.empty()) {
      Throw(ErrorCode::kInvalidArgument, "{}: an empty entry (expected host[:slots],...)", where);
    }
    const size_t colon = entry.find(':');
    const std::string host = CheckHost(entry.substr(0, colon), where);
    int slots = 1;
    if (colon != std::string_view::npos) {
      slots = ParseSlots(entry.substr(colon + 1), where,
                         fmt::format("slots '{}' of {}", entry.substr(colon + 1), host));
    }
    Add(&hosts, host, slots);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return hosts;
}

std::vector<HostSlots> ParseHostfile(std::string_view text, const std::string& path) {
  std::vector<HostSlots> hosts;
  int line_number = 0;
  size_t start = 0;
  while (start < text.size()) {
    size_t nl = text.find('\n', start);
    if (nl == std::string_view::npos) nl = text.size();
    std::string_view line = text.substr(start, nl - start);
    start = nl + 1;
    ++line_number;
    if (const size_t hash = line.find('#'); hash != std::string_view::npos) {
      line = line.substr(0, hash);
    }
    std::istringstream words{std::string(line)};
    std::string host_word;
    if (!(words >> host_word)) continue;  // blank or comment only
    const std::string where = fmt::format("{}:{}", path, line_number);
    const std::string host = CheckHost(host_word, where);
    int slots = 1;
    int max_slots = 0;
    std::string word;
    while (words >> word) {
      const size_t eq = word.find('=');
      const std::string key = word.substr(0, eq);
      if (eq == std::string::npos) {
        Throw(ErrorCode::kInvalidArgument,
              "{}: '{}': expected key=value after the host (slots=N, max_slots=N)", where, word);
      }
      const std::string_view value = std::string_view(word).substr(eq + 1);
      if (key == "slots" || key == "count" || key == "cpu") {
        slots = ParseSlots(value, where, word);
      } else if (key == "max_slots" || key == "max-slots") {
        max_slots = ParseSlots(value, where, word);
      } else {
        Throw(ErrorCode::kInvalidArgument, "{}: unknown key '{}' (known: slots, max_slots)",
              where, key);
      }
    }
    if (max_slots != 0 && max_slots < slots) {
      Throw(ErrorCode::kInvalidArgument, "{}: max_slots={} is less than slots={}", where,
            max_slots, slots);
    }
    Add(&hosts, host, slots);
  }
  if (hosts.empty()) {
    Throw(ErrorCode::kInvalidArgument, "hostfile {}: no hosts (only blank or comment lines)", path);
  }
  return hosts;
}

std::vector<HostSlots> ReadHostfile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    Throw(ErrorCode::kNotFound, "--hostfile {}: cannot open: {}", path, std::strerror(errno));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    Throw(ErrorCode::kNotFound, "--hostfile {}: cannot read: {}", path, std::strerror(errno));
  }
  return ParseHostfile(text.str(), path);
}

int TotalSlots(const std::vector<HostSlots>& hosts) {
  int total = 0;
  for (const auto& h : hosts) total += h.slots;
  return total;
}

std::vector<Placement> PlaceRanks(const std::vector<HostSlots>& hosts, int np) {
  const int total = TotalSlots(hosts);
  if (np < 1) Throw(ErrorCode::kInvalidArgument, "-np {}: expected at least 1 rank", np);
  if (np > total) {
    Throw(ErrorCode::kInvalidArgument,
          "-np {} but the hosts have only {} slot(s) in all ({}); give more slots "
          "(-H host:N, or slots=N in the hostfile) or a smaller -np",
          np, total, Describe(hosts));
  }
  std::vector<Placement> out;
  for (const auto& h : hosts) {
    const int here = std::min(h.slots, np - static_cast<int>(out.size()));
    for (int i = 0; i < here; ++i) {
      out.push_back({static_cast<int>(out.size()), h.host, i, here});
    }
    if (static_cast<int>(out.size()) == np) break;
  }
  return out;
}

}  // namespace pipesgd::launcher
