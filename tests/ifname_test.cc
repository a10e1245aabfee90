// Interface selection: the NCCL_SOCKET_IFNAME grammar (prefixes, ^ to exclude, = for exact
// names, bad input rejected by name), the default order (the rendezvous subnet, the route,
// anything but lo/docker/virbr, docker/virbr, lo), as the worker and the ssh launcher use it.
#include <gtest/gtest.h>

#include "core/base/error.h"
#include "transport/ifname.h"

namespace pipesgd::transport {
namespace {

TEST(IfnameGrammar, PrefixListMatchesByPrefix) {
  IfnameFilter f = ParseIfnameFilter("eth,ib", "PIPESGD_SOCKET_IFNAME");
  EXPECT_FALSE(f.exclude);
  EXPECT_FALSE(f.exact);
  EXPECT_EQ(f.names, (std::vector<std::string>{"eth", "ib"}));
  EXPECT_TRUE(f.Admits("eth0"));
  EXPECT_TRUE(f.Admits("eth"));
  EXPECT_TRUE(f.Admits("ib1"));
  EXPECT_FALSE(f.Admits("enp3s0"));
  EXPECT_FALSE(f.Admits("et"));
  EXPECT_EQ(f.ToString(), "eth,ib");
}

TEST(IfnameGrammar, EqualsMakesNamesExact) {
  IfnameFilter f = ParseIfnameFilter("=eth0,ib1", "x");
  EXPECT_TRUE(f.exact);
  EXPECT_TRUE(f.Admits("eth0"));
  EXPECT_FALSE(f.Admits("eth01"));
  EXPECT_FALSE(f.Admits("eth"));
  EXPECT_TRUE(f.Admits("ib1"));
  EXPECT_EQ(f.ToString(), "=eth0,ib1");
}

TEST(IfnameGrammar, CaretExcludes) {
  IfnameFilter f = ParseIfnameFilter("^docker,lo", "x");
  EXPECT_TRUE(f.exclude);
  EXPECT_FALSE(f.Admits("docker0"));
  EXPECT_FALSE(f.Admits("lo"));
  EXPECT_FALSE(f.Admits("lo2"));  // prefix
  EXPECT_TRUE(f.Admits("eth0"));
  EXPECT_EQ(f.ToString(), "^docker,lo");
}

TEST(IfnameGrammar, CaretEqualsExcludesExactNames) {
  IfnameFilter f = ParseIfnameFilter("^=docker0", "x");
  EXPECT_TRUE(f.exclude);
  EXPECT_TRUE(f.exact);
  EXPECT_FALSE(f.Admits("docker0"));
  EXPECT_TRUE(f.Admits("docker1"));
  EXPECT_EQ(f.ToString(), "^=docker0");
}

void ExpectRejected(const std::string& text, const std::string& fragment) {
  try {
    ParseIfnameFilter(text, "comm.network_interface");
    ADD_FAILURE() << "'" << text << "' was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    const std::string what = e.what();
    EXPECT_NE(what.find("comm.network_interface = '" + text + "'"), std::string::npos) << what;
    EXPECT_NE(what.find(fragment), std::string::npos) << what;
  }
}

TEST(IfnameGrammar, BadInputIsRejectedByName) {
  ExpectRejected("", "no interface name");
  ExpectRejected("^", "no interface name");
  ExpectRejected("^=", "no interface name");
  ExpectRejected("eth0,", "an empty entry");
  ExpectRejected(",eth0", "an empty entry");
  ExpectRejected("eth0,,lo", "an empty entry");
  ExpectRejected("averyveryverylongname", "longer than an interface name can be (15 characters)");
  ExpectRejected("eth0 ,lo", "contains ' '");
  ExpectRejected("eth0,^lo", "contains '^'");
  ExpectRejected("eth0:1", "contains ':'");
}

std::vector<NetInterface> Lab() {
  return {{"lo", "127.0.0.1", 8},
          {"docker0", "172.17.0.1", 16},
          {"eth0", "10.0.0.2", 24},
          {"eth1", "192.168.5.7", 24},
          {"virbr0", "192.168.122.1", 24}};
}

TEST(ChooseInterface, PrefersTheRendezvousSubnet) {
  InterfaceChoice c = ChooseInterface(Lab(), std::nullopt, "", "192.168.5.1", "10.0.0.2");
  EXPECT_EQ(c.iface.name, "eth1");
  EXPECT_EQ(c.iface.ip, "192.168.5.7");
  EXPECT_EQ(c.reason, "on the subnet 192.168.5.0/24 of the rendezvous address 192.168.5.1");
}

TEST(ChooseInterface, LoopbackRendezvousPicksLo) {
  InterfaceChoice c = ChooseInterface(Lab(), std::nullopt, "", "127.0.0.1", "127.0.0.1");
  EXPECT_EQ(c.iface.name, "lo");
  EXPECT_EQ(c.reason, "on the subnet 127.0.0.0/8 of the rendezvous address 127.0.0.1");
}

TEST(ChooseInterface, OffSubnetFollowsTheRoute) {
  InterfaceChoice c = ChooseInterface(Lab(), std::nullopt, "", "8.8.8.8", "192.168.5.7");
  EXPECT_EQ(c.iface.name, "eth1");
  EXPECT_EQ(c.reason, "the route to the rendezvous address 8.8.8.8 goes through it");
}

TEST(ChooseInterface, RouteThroughDockerIsNotTakenWhileSomethingElseExists) {
  InterfaceChoice c = ChooseInterface(Lab(), std::nullopt, "", "8.8.8.8", "172.17.0.1");
  EXPECT_EQ(c.iface.name, "eth0");
  EXPECT_EQ(c.reason, "no interface is on the rendezvous address's subnet; first interface other "
                      "than lo, docker* and virbr*");
}

TEST(ChooseInterface, DockerOnlyWhenNothingElseThenLo) {
  std::vector<NetInterface> few = {{"lo", "127.0.0.1", 8}, {"docker0", "172.17.0.1", 16}};
  EXPECT_EQ(ChooseInterface(few, std::nullopt, "", "8.8.8.8", "").iface.name, "docker0");
  std::vector<NetInterface> only_lo = {{"lo", "127.0.0.1", 8}};
  InterfaceChoice c = ChooseInterface(only_lo, std::nullopt, "", "8.8.8.8", "");
  EXPECT_EQ(c.iface.name, "lo");
  EXPECT_EQ(c.reason, "lo is the only interface");
}

TEST(ChooseInterface, FilterNarrowsFirstAndIsNamedInTheReason) {
  auto filter = ParseIfnameFilter("^eth1", "PIPESGD_SOCKET_IFNAME");
  InterfaceChoice c = ChooseInterface(Lab(), filter, "PIPESGD_SOCKET_IFNAME", "192.168.5.1", "");
  EXPECT_EQ(c.iface.name, "eth0");
  EXPECT_EQ(c.reason, "no interface is on the rendezvous address's subnet; first interface other "
                      "than lo, docker* and virbr* among those PIPESGD_SOCKET_IFNAME = '^eth1' "
                      "admits");
  auto exact_lo = ParseIfnameFilter("=lo", "comm.network_interface");
  EXPECT_EQ(ChooseInterface(Lab(), exact_lo, "comm.network_interface", "10.0.0.1", "").iface.ip,
            "127.0.0.1");
}

TEST(ChooseInterface, FilterThatAdmitsNothingListsTheInterfaces) {
  auto filter = ParseIfnameFilter("ib", "comm.network_interface");
  try {
    ChooseInterface(Lab(), filter, "comm.network_interface", "10.0.0.1", "");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_STREQ(e.what(),
                 "comm.network_interface = 'ib' admits none of this host's interfaces (lo "
                 "127.0.0.1/8, docker0 172.17.0.1/16, eth0 10.0.0.2/24, eth1 192.168.5.7/24, "
                 "virbr0 192.168.122.1/24)");
  }
}

TEST(ChooseInterface, NoInterfacesAtAll) {
  try {
    ChooseInterface({}, std::nullopt, "", "10.0.0.1", "");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
  }
}

// A dual-stack host: IPv4 entries first, as ListNetInterfaces lists them; ib0 is IPv6 only.
std::vector<NetInterface> Lab6() {
  return {{"lo", "127.0.0.1", 8},           {"eth0", "10.0.0.2", 24},
          {"eth1", "192.168.5.7", 24},      {"lo", "::1", 128},
          {"eth0", "2001:db8:1::2", 64},    {"eth1", "2001:db8:5::7", 64},
          {"ib0", "2001:db8:9::9", 64}};
}

// An IPv6 rendezvous address picks the interface as an IPv4 one does (it picked eth0 for ::1:
// the data went over eth0, not loopback), by the interface's IPv4 address where it has one.
TEST(ChooseInterface, Ipv6RendezvousPicksByPrefix) {
  InterfaceChoice c = ChooseInterface(Lab6(), std::nullopt, "", "::1", "::1");
  EXPECT_EQ(c.iface.name, "lo");
  EXPECT_EQ(c.iface.ip, "127.0.0.1");
  EXPECT_EQ(c.reason, "on the prefix ::1/128 of the rendezvous address ::1");
  // lo without an IPv6 address (IPv6 off on it): still lo.
  c = ChooseInterface(Lab(), std::nullopt, "", "::1", "");
  EXPECT_EQ(c.iface.name, "lo");
  EXPECT_EQ(c.iface.ip, "127.0.0.1");
  c = ChooseInterface(Lab6(), std::nullopt, "", "2001:db8:5::1", "2001:db8:1::2");
  EXPECT_EQ(c.iface.name, "eth1");
  EXPECT_EQ(c.iface.ip, "192.168.5.7");
  EXPECT_EQ(c.reason, "on the prefix 2001:db8:5::/64 of the rendezvous address 2001:db8:5::1");
  c = ChooseInterface(Lab6(), std::nullopt, "", "2001:db8:9::1", "");
  EXPECT_EQ(c.iface.name, "ib0");  // no IPv4 address: its IPv6 one
  EXPECT_EQ(c.iface.ip, "2001:db8:9::9");
  // Off every prefix: the route, as for IPv4.
  c = ChooseInterface(Lab6(), std::nullopt, "", "2001:db8:77::1", "2001:db8:5::7");
  EXPECT_EQ(c.iface.name, "eth1");
  EXPECT_EQ(c.iface.ip, "192.168.5.7");
  // A filter narrows first.
  c = ChooseInterface(Lab6(), ParseIfnameFilter("eth0", "x"), "x", "::1", "::1");
  EXPECT_EQ(c.iface.name, "eth0");
  EXPECT_EQ(c.iface.ip, "10.0.0.2");
}

TEST(ChooseInterface, Ipv4MappedAddressesAreIpv4) {
  InterfaceChoice c = ChooseInterface(Lab6(), std::nullopt, "", "::ffff:192.168.5.1", "");
  EXPECT_EQ(c.iface.name, "eth1");
  EXPECT_EQ(c.iface.ip, "192.168.5.7");
  EXPECT_EQ(c.reason, "on the subnet 192.168.5.0/24 of the rendezvous address 192.168.5.1");
  c = ChooseInterface(Lab6(), std::nullopt, "", "::ffff:127.0.0.1", "::ffff:127.0.0.1");
  EXPECT_EQ(c.iface.name, "lo");
  EXPECT_EQ(c.iface.ip, "127.0.0.1");
}

TEST(ListNetInterfaces, ThisHostHasLoopback) {
  bool lo = false;
  for (const auto& i : ListNetInterfaces()) lo = lo || (i.name == "lo" && i.ip == "127.0.0.1" && i.prefix_len == 8);
  EXPECT_TRUE(lo);
}

// The ssh launcher chooses rank 0's rendezvous address from the list rank 0's host reported,
// with the address ssh reached it at as the route: the worker's rules, so both pick the same.
const std::vector<NetInterface> kLead = {
    {"lo", "127.0.0.1", 8},
    {"docker0", "172.17.0.1", 16},
    {"eth0", "10.0.0.3", 24},
    {"ib0", "192.168.1.3", 24},
};

std::string LauncherPick(const std::string& spec, const std::string& ssh_address) {
  return ChooseInterface(kLead, ParseIfnameFilter(spec, "comm.network_interface"),
                         "comm.network_interface", "", ssh_address)
      .iface.name;
}

TEST(ChooseInterface, AsTheSshLauncherUsesIt) {
  EXPECT_EQ(LauncherPick("eth,ib", "192.168.1.3"), "ib0");  // the route, when admitted
  EXPECT_EQ(LauncherPick("eth,ib", "172.17.0.1"), "eth0");  // else the first admitted
  EXPECT_EQ(LauncherPick("^docker,lo", ""), "eth0");
  EXPECT_EQ(LauncherPick("^docker,eth", ""), "ib0");   // lo only when nothing else is admitted
  EXPECT_EQ(LauncherPick("^=docker0", "172.17.0.1"), "eth0");
  EXPECT_EQ(LauncherPick("=lo", "10.0.0.3"), "lo");
  EXPECT_EQ(LauncherPick("docker,lo", "127.0.0.1"), "docker0");  // docker* before lo
  try {
    LauncherPick("=eth1", "10.0.0.3");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_STREQ(e.what(),
                 "comm.network_interface = '=eth1' admits none of this host's interfaces (lo "
                 "127.0.0.1/8, docker0 172.17.0.1/16, eth0 10.0.0.3/24, ib0 192.168.1.3/24)");
  }
}

TEST(ChooseLocalInterface, LoopbackOnThisHost) {
  const InterfaceChoice lo =
      ChooseLocalInterface(ParseIfnameFilter("=lo", "x"), "x", "127.0.0.1", 29500);
  EXPECT_EQ(lo.iface.name, "lo");
  EXPECT_EQ(lo.iface.ip, "127.0.0.1");
  const InterfaceChoice route = ChooseLocalInterface(std::nullopt, "", "127.0.0.1", 29500);
  EXPECT_EQ(route.iface.ip, "127.0.0.1");
  EXPECT_EQ(route.iface.name, "lo");
  EXPECT_EQ(route.reason, "on the subnet 127.0.0.0/8 of the rendezvous address 127.0.0.1");
}

TEST(ChooseLocalInterface, AFilterThatAdmitsNothingIsNamed) {
  try {
    ChooseLocalInterface(ParseIfnameFilter("=nosuchif0", "PIPESGD_SOCKET_IFNAME"),
                         "PIPESGD_SOCKET_IFNAME", "127.0.0.1", 29500);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("PIPESGD_SOCKET_IFNAME = '=nosuchif0' admits none"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace pipesgd::transport
