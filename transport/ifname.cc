#include "transport/ifname.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/base/error.h"
#include "transport/message_io.h"

namespace pipesgd::transport {
namespace {

std::string Describe(const std::vector<LocalInterface>& interfaces) {
  if (interfaces.empty()) return "none";
  std::vector<std::string> parts;
  for (const auto& i : interfaces) {
    parts.push_back(fmt::format("{} {}{}", i.name, i.address, i.up ? "" : " (down)"));
  }
  return fmt::format("{}", fmt::join(parts, ", "));
}

}  // namespace

InterfaceFilter ParseInterfaceFilter(std::string_view spec) {
  InterfaceFilter filter;
  filter.spec = std::string(spec);
  auto fail = [&](const std::string& why) {
    Throw(ErrorCode::kInvalidArgument,
          "network interface '{}': {} (expected NCCL_SOCKET_IFNAME grammar: a comma list of name "
          "prefixes such as eth,ib; ^ first to exclude them, = to match whole names: =eth0, "
          "^docker,lo, ^=docker0)",
          spec, why);
  };
  std::string_view rest = spec;
  if (!rest.empty() && rest.front() == '^') {
    filter.exclude = true;
    rest.remove_prefix(1);
  }
  if (!rest.empty() && rest.front() == '=') {
    filter.exact = true;
    rest.remove_prefix(1);
  }
  if (rest.empty()) fail("no interface names");
  size_t start = 0;
  while (true) {
    const size_t comma = rest.find(',', start);
    const std::string_view name =
        rest.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    if (name.empty()) fail("an empty entry in the list");
    for (char c : name) {
      if (c == '^' || c == '=') {
        fail(fmt::format("'{}' in '{}': ^ and = may only lead the whole list", c, name));
      }
      if (c == '/' || static_cast<unsigned char>(c) <= ' ' || c == 0x7f) {
        fail(fmt::format("'{}' holds a character no interface name has", name));
      }
    }
    if (filter.exact && name.size() >= IFNAMSIZ) {
      fail(fmt::format("'{}' is longer than an interface name can be ({} bytes)", name,
                       IFNAMSIZ - 1));
    }
    filter.names.emplace_back(name);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return filter;
}

bool InterfaceMatches(const InterfaceFilter& filter, std::string_view name) {
  bool listed = false;
  for (const auto& entry : filter.names) {
    listed |= filter.exact ? name == entry : name.substr(0, entry.size()) == entry;
  }
  return listed != filter.exclude;
}

std::vector<LocalInterface> ListIpv4Interfaces() {
  ifaddrs* raw = nullptr;
  if (getifaddrs(&raw) != 0) {
    Throw(ErrorCode::kIo, "cannot list this host's network interfaces: {}", std::strerror(errno));
  }
  std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> list(raw, &freeifaddrs);
  std::vector<LocalInterface> out;
  for (const ifaddrs* a = raw; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if (inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) == nullptr) continue;
    out.push_back({a->ifa_name, text, (a->ifa_flags & IFF_UP) != 0,
                   (a->ifa_flags & IFF_LOOPBACK) != 0});
  }
  return out;
}

LocalInterface PickInterface(const std::vector<LocalInterface>& interfaces,
                             const InterfaceFilter& filter,
                             const std::optional<std::string>& route_address) {
  const LocalInterface* first = nullptr;
  const LocalInterface* first_loopback = nullptr;
  for (const auto& i : interfaces) {
    if (!i.up || !InterfaceMatches(filter, i.name)) continue;
    if (route_address && i.address == *route_address) return i;
    if (i.loopback) {
      if (first_loopback == nullptr) first_loopback = &i;
    } else if (first == nullptr) {
      first = &i;
    }
  }
  if (first != nullptr) return *first;
  if (first_loopback != nullptr) return *first_loopback;
  Throw(ErrorCode::kInvalidArgument,
        "network interface '{}': no interface of this host that is up and has an IPv4 address "
        "matches (interfaces here: {})",
        filter.spec, Describe(interfaces));
}

LocalInterface ChooseLocalInterface(const std::string& spec, const std::string& toward_host,
                                    uint16_t toward_port) {
  const std::vector<LocalInterface> interfaces = ListIpv4Interfaces();
  if (spec.empty()) {
    const std::string address = LocalIpToward(toward_host, toward_port);
    for (const auto& i : interfaces) {
      if (i.address == address) return i;
    }
    return {"?", address, true, false};
  }
  const InterfaceFilter filter = ParseInterfaceFilter(spec);
  std::optional<std::string> route;
  try {
    route = LocalIpToward(toward_host, toward_port);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kUnavailable) throw;  // a host that does not resolve is an error
  }
  return PickInterface(interfaces, filter, route);
}

}  // namespace pipesgd::transport
