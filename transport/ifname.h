// Choosing the local network interface (and so the address) a rank listens on and publishes, by
// the grammar of NCCL_SOCKET_IFNAME, which users of multi-NIC clusters already write:
//
//   eth,ib        interfaces whose names start with "eth" or "ib" (a comma list of prefixes)
//   ^docker,lo    every interface except those starting with "docker" or "lo"
//   =eth0         exactly "eth0" ("=" makes every name in the list exact)
//   ^=docker0     every interface except exactly "docker0"
//
// "^" and "=" apply to the whole list and may only lead it (in that order). Config field:
// comm.network_interface (configs/pipesgd.proto); launcher flag: --network-interface.
// Kept in its own small file so that every transport (TCP today; UCX, ibverbs) shares one parser.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pipesgd::transport {

struct InterfaceFilter {
  std::string spec;  // as written, for messages
  bool exclude = false;  // leading '^': the names say which interfaces NOT to use
  bool exact = false;    // leading '=': whole names instead of prefixes
  std::vector<std::string> names;  // non-empty entries, in the order written
};

// Parses `spec` (non-empty). Throws Error kInvalidArgument naming the spec and the problem: an
// empty list or entry ("eth0,,ib"), whitespace or a character an interface name cannot hold
// ('/', ':'), a name longer than 15 bytes (IFNAMSIZ - 1) with '=', a '^' or '=' in the wrong place.
InterfaceFilter ParseInterfaceFilter(std::string_view spec);

// True when interface `name` is allowed by the filter.
bool InterfaceMatches(const InterfaceFilter& filter, std::string_view name);

// An IPv4 address of this host and the interface that holds it.
struct LocalInterface {
  std::string name;     // "eth0"
  std::string address;  // numeric IPv4, "10.0.0.3"
  bool up = true;
  bool loopback = false;
};

// Every IPv4 address on this host, in the kernel's order (getifaddrs). Throws Error kIo if the
// list cannot be read.
std::vector<LocalInterface> ListIpv4Interfaces();

// Picks the interface among `interfaces` (pure; ChooseLocalInterface feeds it this host's list):
// of the interfaces that are up and match `filter`, the one holding `route_address` (the source
// address of this host's route toward the rendezvous) if it matches, else the first non-loopback
// match, else the first (loopback) match. Throws Error kInvalidArgument naming the spec and
// listing every interface present when nothing matches.
LocalInterface PickInterface(const std::vector<LocalInterface>& interfaces,
                             const InterfaceFilter& filter,
                             const std::optional<std::string>& route_address);

// The interface and address this rank should listen on and publish so that peers reach it.
// `spec` empty: the source address of the route toward toward_host:toward_port (what the kernel
// would use) and the interface that holds it. `spec` set: PickInterface on this host's
// interfaces. Throws Error kInvalidArgument (bad spec, nothing matches, host does not resolve),
// kUnavailable (no route toward the host), kIo (cannot list interfaces).
LocalInterface ChooseLocalInterface(const std::string& spec, const std::string& toward_host,
                                    uint16_t toward_port);

}  // namespace pipesgd::transport
