#include "transport/ifname.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <algorithm>
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

// An IPv6 address's 16 bytes; false for anything else (IPv4 text included).
bool ParseIpv6(const std::string& text, in6_addr* out) {
  return inet_pton(AF_INET6, text.c_str(), out) == 1;
}

// "::ffff:10.0.0.1" (an IPv4 peer on a dual-stack socket) is the IPv4 address it carries.
std::string Unmapped(const std::string& ip) {
  in6_addr a{};
  if (!ParseIpv6(ip, &a) || !IN6_IS_ADDR_V4MAPPED(&a)) return ip;
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, a.s6_addr + 12, buf, sizeof(buf));
  return buf;
}

bool IsIpv6(const NetInterface& iface) { return iface.ip.find(':') != std::string::npos; }

// The first `bits` bits of `a`, the rest zero.
in6_addr Masked(in6_addr a, int bits) {
  for (int i = 0; i < 16; ++i) {
    const int keep = std::clamp(bits - 8 * i, 0, 8);
    a.s6_addr[i] &= static_cast<uint8_t>(keep == 0 ? 0 : 0xff << (8 - keep));
  }
  return a;
}

bool OnPrefix(const NetInterface& iface, const in6_addr& target) {
  in6_addr ip{};
  if (!ParseIpv6(iface.ip, &ip) || iface.prefix_len < 0 || iface.prefix_len > 128) return false;
  const in6_addr a = Masked(ip, iface.prefix_len), b = Masked(target, iface.prefix_len);
  return std::memcmp(a.s6_addr, b.s6_addr, 16) == 0;
}

std::string Prefix(const NetInterface& iface) {
  in6_addr ip{};
  ParseIpv6(iface.ip, &ip);
  const in6_addr net = Masked(ip, iface.prefix_len);
  char buf[INET6_ADDRSTRLEN] = {};
  inet_ntop(AF_INET6, &net, buf, sizeof(buf));
  return fmt::format("{}/{}", buf, iface.prefix_len);
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
  std::vector<NetInterface> out, ipv6;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (!a->ifa_addr || !(a->ifa_flags & IFF_UP)) continue;
    if (a->ifa_addr->sa_family == AF_INET) {
      const auto* sin = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
      char ip[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &sin->sin_addr, ip, sizeof(ip));
      int prefix = 32;
      if (a->ifa_netmask) {
        const uint32_t mask =
            ntohl(reinterpret_cast<const sockaddr_in*>(a->ifa_netmask)->sin_addr.s_addr);
        prefix = __builtin_popcount(mask);
      }
      out.push_back({a->ifa_name, ip, prefix});
    } else if (a->ifa_addr->sa_family == AF_INET6) {
      const auto* sin6 = reinterpret_cast<const sockaddr_in6*>(a->ifa_addr);
      // Link-local addresses are usable only with their interface's scope: no rendezvous or
      // data address here is one.
      if (IN6_IS_ADDR_LINKLOCAL(&sin6->sin6_addr)) continue;
      char ip[INET6_ADDRSTRLEN] = {};
      inet_ntop(AF_INET6, &sin6->sin6_addr, ip, sizeof(ip));
      int prefix = 128;
      if (a->ifa_netmask) {
        const auto* mask = reinterpret_cast<const sockaddr_in6*>(a->ifa_netmask);
        prefix = 0;
        for (uint8_t byte : mask->sin6_addr.s6_addr) prefix += __builtin_popcount(byte);
      }
      ipv6.push_back({a->ifa_name, ip, prefix});
    }
  }
  freeifaddrs(list);
  // IPv4 first: the choices that take the first suitable interface keep taking an IPv4 one.
  out.insert(out.end(), ipv6.begin(), ipv6.end());
  return out;
}

InterfaceChoice ChooseInterface(const std::vector<NetInterface>& interfaces,
                                const std::optional<IfnameFilter>& filter,
                                std::string_view filter_source, const std::string& target_text,
                                const std::string& routed_text) {
  if (interfaces.empty()) {
    Throw(ErrorCode::kUnavailable, "no network interface with an IP address is up");
  }
  // IPv4 candidates first, so that the rules below which take the first suitable interface take
  // an IPv4 one as they always have; IPv6 ones serve an IPv6 rendezvous address's rules.
  std::vector<NetInterface> candidates;
  for (bool v6 : {false, true}) {
    for (const auto& i : interfaces) {
      if (IsIpv6(i) == v6 && (!filter || filter->Admits(i.name))) candidates.push_back(i);
    }
  }
  if (candidates.empty()) {
    Throw(ErrorCode::kInvalidArgument, "{} = '{}' admits none of this host's interfaces ({})",
          filter_source, filter->ToString(), List(interfaces));
  }
  const std::string narrowed =
      filter ? fmt::format(" among those {} = '{}' admits", filter_source, filter->ToString()) : "";
  const std::string target_ip = Unmapped(target_text);
  const std::string routed_ip = Unmapped(routed_text);
  // An interface chosen by one of its IPv6 addresses is used by its IPv4 address where it has
  // one, as every other choice is: the ranks' data connections are made to the address chosen
  // here, and any rank may have reached the rendezvous over the other family.
  const auto same_interface_ipv4 = [&](const NetInterface& chosen) {
    if (!IsIpv6(chosen)) return chosen;
    for (const auto& i : candidates) {
      if (i.name == chosen.name && !IsIpv6(i)) return i;
    }
    return chosen;
  };

  uint32_t target = 0;
  in6_addr target6{};
  if (ParseIpv4(target_ip, &target)) {
    const NetInterface* best = nullptr;
    for (const auto& i : candidates) {
      if (IsIpv6(i) || !OnSubnet(i, target)) continue;
      if (!best || i.ip == routed_ip) best = &i;
      if (i.ip == routed_ip) break;
    }
    if (best) {
      return {*best, fmt::format("on the subnet {} of the rendezvous address {}{}", Subnet(*best),
                                 target_ip, narrowed)};
    }
  } else if (ParseIpv6(target_ip, &target6)) {
    const NetInterface* best = nullptr;
    for (const auto& i : candidates) {
      if (!IsIpv6(i) || !OnPrefix(i, target6)) continue;
      if (!best || i.ip == routed_ip) best = &i;
      if (i.ip == routed_ip) break;
    }
    if (best) {
      return {same_interface_ipv4(*best),
              fmt::format("on the prefix {} of the rendezvous address {}{}", Prefix(*best),
                          target_ip, narrowed)};
    }
    // ::1 where lo lists no IPv6 address (IPv6 off on it): lo by its IPv4 loopback address,
    // as for 127.0.0.1.
    if (IN6_IS_ADDR_LOOPBACK(&target6)) {
      for (const auto& i : candidates) {
        uint32_t ip = 0;
        if (!IsIpv6(i) && ParseIpv4(i.ip, &ip) && (ip >> 24) == 127) {
          return {i, fmt::format("the rendezvous address {} is loopback{}", target_ip, narrowed)};
        }
      }
    }
  }
  for (const auto& i : candidates) {
    if (!routed_ip.empty() && i.ip == routed_ip && !IsFallbackInterface(i.name)) {
      return {same_interface_ipv4(i),
              fmt::format("the route to the rendezvous address {} goes through it{}", target_ip,
                          narrowed)};
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
