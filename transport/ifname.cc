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

constexpr size_t kMaxIfname = IFNAMSIZ - 1;  // 15

bool ParseIpv4(const std::string& text, uint32_t* out) {
  in_addr addr{};
  if (inet_pton(AF_INET, text.c_str(), &addr) != 1) return false;
  *out = ntohl(addr.s_addr);
  return true;
}

bool OnSubnet(const NetInterface& iface, uint32_t target) {
  uint32_t ip = 0;
  if (!ParseIpv4(iface.ip, &ip) || iface.prefix_len < 0 || iface.prefix_len > 32) return false;
  const uint32_t mask = iface.prefix_len == 0 ? 0 : ~uint32_t{0} << (32 - iface.prefix_len);
  return (ip & mask) == (target & mask);
}

std::string Subnet(const NetInterface& iface) {
  uint32_t ip = 0;
  ParseIpv4(iface.ip, &ip);
  const uint32_t mask = iface.prefix_len == 0 ? 0 : ~uint32_t{0} << (32 - iface.prefix_len);
  in_addr net{htonl(ip & mask)};
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &net, buf, sizeof(buf));
  return fmt::format("{}/{}", buf, iface.prefix_len);
}

std::string List(const std::vector<NetInterface>& interfaces) {
  std::string s;
  for (const auto& i : interfaces) {
    if (!s.empty()) s += ", ";
    s += fmt::format("{} {}/{}", i.name, i.ip, i.prefix_len);
  }
  return s.empty() ? "none" : s;
}

}  // namespace

bool IfnameFilter::Admits(std::string_view ifname) const {
  bool match = false;
  for (const auto& n : names) {
    if (exact ? ifname == n : ifname.substr(0, n.size()) == n) {
      match = true;
      break;
    }
  }
  return exclude ? !match : match;
}

std::string IfnameFilter::ToString() const {
  std::string s = std::string(exclude ? "^" : "") + (exact ? "=" : "");
  for (size_t i = 0; i < names.size(); ++i) s += (i ? "," : "") + names[i];
  return s;
}

IfnameFilter ParseIfnameFilter(std::string_view text, std::string_view source) {
  IfnameFilter filter;
  std::string_view rest = text;
  auto fail = [&](const std::string& what) {
    Throw(ErrorCode::kInvalidArgument,
          "{} = '{}': {} (expected a comma-separated list of interface name prefixes, '^' first "
          "to exclude, '=' for exact names, e.g. eth0 or ^docker,lo or =eth1)",
          source, text, what);
  };
  if (!rest.empty() && rest.front() == '^') {
    filter.exclude = true;
    rest.remove_prefix(1);
  }
  if (!rest.empty() && rest.front() == '=') {
    filter.exact = true;
    rest.remove_prefix(1);
  }
  if (rest.empty()) fail("no interface name");
  size_t start = 0;
  while (true) {
    const size_t comma = rest.find(',', start);
    std::string_view name = rest.substr(start, comma == std::string_view::npos ? rest.npos : comma - start);
    if (name.empty()) fail("an empty entry");
    if (name.size() > kMaxIfname) {
      fail(fmt::format("'{}' is longer than an interface name can be ({} characters)", name,
                       kMaxIfname));
    }
    for (char c : name) {
      if (c == ' ' || c == '\t' || c == '/' || c == '^' || c == '=' || c == ':' ||
          static_cast<unsigned char>(c) < 0x21 || static_cast<unsigned char>(c) > 0x7e) {
        fail(fmt::format("'{}' contains '{}', which cannot be in an interface name here", name, c));
      }
    }
    filter.names.emplace_back(name);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return filter;
}

bool IsFallbackInterface(std::string_view name) {
  return name == "lo" || name.substr(0, 6) == "docker" || name.substr(0, 5) == "virbr";
}

std::vector<NetInterface> ListNetInterfaces() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    Throw(ErrorCode::kIo, "cannot list network interfaces (getifaddrs): {}", std::strerror(errno));
  }
  std::vector<NetInterface> out;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET || !(a->ifa_flags & IFF_UP)) continue;
    const auto* sin = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    char ip[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &sin->sin_addr, ip, sizeof(ip));
    int prefix = 32;
    if (a->ifa_netmask) {
      const uint32_t mask = ntohl(reinterpret_cast<const sockaddr_in*>(a->ifa_netmask)->sin_addr.s_addr);
      prefix = __builtin_popcount(mask);
    }
    out.push_back({a->ifa_name, ip, prefix});
  }
  freeifaddrs(list);
  return out;
}

InterfaceChoice ChooseInterface(const std::vector<NetInterface>& interfaces,
                                const std::optional<IfnameFilter>& filter,
                                std::string_view filter_source, const std::string& target_ip,
                                const std::string& routed_ip) {
  if (interfaces.empty()) {
    Throw(ErrorCode::kUnavailable, "no network interface with an IPv4 address is up");
  }
  std::vector<NetInterface> candidates;
  for (const auto& i : interfaces) {
    if (!filter || filter->Admits(i.name)) candidates.push_back(i);
  }
  if (candidates.empty()) {
    Throw(ErrorCode::kInvalidArgument, "{} = '{}' admits none of this host's interfaces ({})",
          filter_source, filter->ToString(), List(interfaces));
  }
  const std::string narrowed =
      filter ? fmt::format(" among those {} = '{}' admits", filter_source, filter->ToString()) : "";

  uint32_t target = 0;
  if (ParseIpv4(target_ip, &target)) {
    const NetInterface* best = nullptr;
    for (const auto& i : candidates) {
      if (!OnSubnet(i, target)) continue;
      if (!best || i.ip == routed_ip) best = &i;
      if (i.ip == routed_ip) break;
    }
    if (best) {
      return {*best, fmt::format("on the subnet {} of the rendezvous address {}{}", Subnet(*best),
                                 target_ip, narrowed)};
    }
  }
  for (const auto& i : candidates) {
    if (!routed_ip.empty() && i.ip == routed_ip && !IsFallbackInterface(i.name)) {
      return {i, fmt::format("the route to the rendezvous address {} goes through it{}",
                             target_ip, narrowed)};
    }
  }
  for (const auto& i : candidates) {
    if (!IsFallbackInterface(i.name)) {
      return {i, fmt::format("no interface is on the rendezvous address's subnet; first "
                             "interface other than lo, docker* and virbr*{}",
                             narrowed)};
    }
  }
  for (const auto& i : candidates) {
    if (i.name != "lo") {
      return {i, fmt::format("only docker*/virbr* interfaces and lo are there{}", narrowed)};
    }
  }
  return {candidates.front(), fmt::format("lo is the only interface{}", narrowed)};
}

InterfaceChoice ChooseLocalInterface(const std::optional<IfnameFilter>& filter,
                                     std::string_view filter_source,
                                     const std::string& toward_host, uint16_t toward_port) {
  const std::string target = ResolveEndpoint(toward_host, toward_port).address().to_string();
  std::string routed;
  try {
    routed = LocalIpToward(toward_host, toward_port);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kUnavailable) throw;
  }
  return ChooseInterface(ListNetInterfaces(), filter, filter_source, target, routed);
}

}  // namespace pipesgd::transport
