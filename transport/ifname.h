// Network interface selection, once, for every user: the TCP transport's listen address, UCX's
// NET_DEVICES, and the ssh launcher's rendezvous address (chosen from rank 0's host's list, which
// its preflight reports). In NCCL_SOCKET_IFNAME's grammar, read from comm.network_interface or
// the PIPESGD_SOCKET_IFNAME environment variable (the callers read those; this file only parses
// and chooses).
//
// Grammar (NCCL's): a comma-separated list of interface name prefixes.
//   eth,ib        interfaces whose name starts with "eth" or "ib"
//   =eth0         exactly eth0 ("=" makes every entry of the list exact)
//   ^docker,lo    every interface except those starting with "docker" or "lo"
//   ^=docker0     every interface except exactly docker0
// Entries are interface names (at most 15 characters, no spaces, no commas); an empty entry is an
// error, not a wildcard.
//
// Default choice, when no filter is given (and, among the interfaces a filter admits, when one is):
//   1. an interface whose subnet contains the rendezvous address (MASTER_ADDR); for a
//      loopback MASTER_ADDR that is lo. An IPv6 address is matched against the interfaces'
//      IPv6 prefixes (::1: lo, also where lo has no IPv6 address), and the interface is then
//      used at its IPv4 address where it has one (the data connections go to the address
//      chosen, as for every other rule); an IPv4-mapped one (::ffff:a.b.c.d) is the IPv4 address;
//   2. the interface the kernel routes to the rendezvous address through, unless it is lo,
//      docker* or virbr*;
//   3. any other interface except lo, docker* and virbr*;
//   4. docker* or virbr*;
//   5. lo.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pipesgd::transport {

struct IfnameFilter {
  bool exclude = false;  // "^": admit every interface that does NOT match
  bool exact = false;    // "=": names are exact, not prefixes
  std::vector<std::string> names;

  // True if the interface called `ifname` is admitted by this filter.
  bool Admits(std::string_view ifname) const;
  // The filter written back in the grammar ("^=docker0,lo").
  std::string ToString() const;
};

// Parses `text` in the grammar above. Throws Error kInvalidArgument naming `source` (e.g.
// "PIPESGD_SOCKET_IFNAME" or "comm.network_interface"), the text and what is wrong.
IfnameFilter ParseIfnameFilter(std::string_view text, std::string_view source);

// One address of an up interface (IPv4, or IPv6 where `ip` holds a ':').
struct NetInterface {
  std::string name;  // "eth0"
  std::string ip;    // "10.0.0.2", "fd00::2"
  int prefix_len = 0;  // 24 for a /24, 64 for an IPv6 /64
};

// Addresses of the interfaces that are up (getifaddrs): the IPv4 ones in the kernel's order,
// then the IPv6 ones but link-local. Throws Error kIo if the list cannot be read.
std::vector<NetInterface> ListNetInterfaces();

// True for lo, docker* and virbr*: used only when nothing else is there.
bool IsFallbackInterface(std::string_view name);

struct InterfaceChoice {
  NetInterface iface;
  std::string reason;  // why, for the log: "on the subnet of the rendezvous address 10.0.0.1"
};

// Chooses among `interfaces` as described above. `filter` (from `filter_source`) narrows the
// candidates first; `target_ip` is the rendezvous address (numeric IPv4 or IPv6, may be empty);
// `routed_ip` is the local address the kernel uses toward it (may be empty). Throws Error
// kInvalidArgument if no interface is admitted, listing the interfaces seen; kUnavailable if
// there are none at all.
InterfaceChoice ChooseInterface(const std::vector<NetInterface>& interfaces,
                                const std::optional<IfnameFilter>& filter,
                                std::string_view filter_source, const std::string& target_ip,
                                const std::string& routed_ip);

// This host's interface toward the rendezvous: ChooseInterface over ListNetInterfaces, with
// `toward_host` (numeric or a name) as the rendezvous address and the source address of the
// kernel's route toward it (no route: the subnet and name rules still apply). Throws as
// ChooseInterface, and Error kInvalidArgument if `toward_host` does not resolve.
InterfaceChoice ChooseLocalInterface(const std::optional<IfnameFilter>& filter,
                                     std::string_view filter_source,
                                     const std::string& toward_host, uint16_t toward_port);

}  // namespace pipesgd::transport
