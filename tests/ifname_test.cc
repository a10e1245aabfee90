// Interface selection: the NCCL_SOCKET_IFNAME grammar (prefixes, ^ to exclude, = for exact
// names, bad input rejected by name) in both spellings (ParseIfnameFilter for the worker,
// ParseInterfaceFilter for the launcher), the default order (the rendezvous subnet, the route,
// anything but lo/docker/virbr, docker/virbr, lo), and the launcher's PickInterface.
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

TEST(ListNetInterfaces, ThisHostHasLoopback) {
  bool lo = false;
  for (const auto& i : ListNetInterfaces()) lo = lo || (i.name == "lo" && i.ip == "127.0.0.1" && i.prefix_len == 8);
  EXPECT_TRUE(lo);
}

// The launcher's spelling of the grammar, and PickInterface.

bool Match(const std::string& spec, const std::string& name) {
  return InterfaceMatches(ParseInterfaceFilter(spec), name);
}

TEST(InterfaceFilter, Parse) {
  InterfaceFilter f = ParseInterfaceFilter("eth,ib");
  EXPECT_FALSE(f.exclude);
  EXPECT_FALSE(f.exact);
  EXPECT_EQ(f.names, (std::vector<std::string>{"eth", "ib"}));
  f = ParseInterfaceFilter("^docker,lo");
  EXPECT_TRUE(f.exclude);
  EXPECT_FALSE(f.exact);
  EXPECT_EQ(f.names, (std::vector<std::string>{"docker", "lo"}));
  f = ParseInterfaceFilter("=eth0");
  EXPECT_FALSE(f.exclude);
  EXPECT_TRUE(f.exact);
  EXPECT_EQ(f.names, (std::vector<std::string>{"eth0"}));
  f = ParseInterfaceFilter("^=docker0,veth1");
  EXPECT_TRUE(f.exclude);
  EXPECT_TRUE(f.exact);
  EXPECT_EQ(f.names, (std::vector<std::string>{"docker0", "veth1"}));
  EXPECT_EQ(f.spec, "^=docker0,veth1");
}

TEST(InterfaceFilter, PrefixesMatchTheStartOfTheName) {
  EXPECT_TRUE(Match("eth", "eth0"));
  EXPECT_TRUE(Match("eth", "eth"));
  EXPECT_TRUE(Match("eth,ib", "ib1"));
  EXPECT_FALSE(Match("eth", "veth0"));
  EXPECT_FALSE(Match("eth0", "eth"));
  EXPECT_TRUE(Match("eth0", "eth01"));  // a prefix, as in NCCL
}

TEST(InterfaceFilter, ExactNames) {
  EXPECT_TRUE(Match("=eth0", "eth0"));
  EXPECT_FALSE(Match("=eth0", "eth01"));
  EXPECT_FALSE(Match("=eth", "eth0"));
  EXPECT_TRUE(Match("=eth0,ib0", "ib0"));
}

TEST(InterfaceFilter, Exclusion) {
  EXPECT_FALSE(Match("^docker,lo", "docker0"));
  EXPECT_FALSE(Match("^docker,lo", "lo"));
  EXPECT_TRUE(Match("^docker,lo", "eth0"));
  EXPECT_FALSE(Match("^=docker0", "docker0"));
  EXPECT_TRUE(Match("^=docker0", "docker01"));
}

std::string ErrorOf(const std::string& spec) {
  try {
    ParseInterfaceFilter(spec);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    const std::string what = e.what();
    const std::string tail =
        " (expected NCCL_SOCKET_IFNAME grammar: a comma list of name prefixes such as eth,ib; ^ "
        "first to exclude them, = to match whole names: =eth0, ^docker,lo, ^=docker0)";
    EXPECT_EQ(what.substr(what.size() - std::min(what.size(), tail.size())), tail) << what;
    return what.substr(0, what.size() - tail.size());
  }
  return "no error";
}

TEST(InterfaceFilter, ErrorsNameTheSpec) {
  EXPECT_EQ(ErrorOf(""), "network interface '': no interface names");
  EXPECT_EQ(ErrorOf("^"), "network interface '^': no interface names");
  EXPECT_EQ(ErrorOf("^="), "network interface '^=': no interface names");
  EXPECT_EQ(ErrorOf("eth0,,ib"), "network interface 'eth0,,ib': an empty entry in the list");
  EXPECT_EQ(ErrorOf("eth0,"), "network interface 'eth0,': an empty entry in the list");
  EXPECT_EQ(ErrorOf("=^eth0"),
            "network interface '=^eth0': '^' in '^eth0': ^ and = may only lead the whole list");
  EXPECT_EQ(ErrorOf("eth0,^ib"),
            "network interface 'eth0,^ib': '^' in '^ib': ^ and = may only lead the whole list");
  EXPECT_EQ(ErrorOf("eth 0"),
            "network interface 'eth 0': 'eth 0' holds a character no interface name has");
  EXPECT_EQ(ErrorOf("=averyveryverylongname"),
            "network interface '=averyveryverylongname': 'averyveryverylongname' is longer than "
            "an interface name can be (15 bytes)");
}

const std::vector<LocalInterface> kHost = {
    {"lo", "127.0.0.1", true, true},
    {"docker0", "172.17.0.1", true, false},
    {"eth0", "10.0.0.3", true, false},
    {"ib0", "192.168.1.3", true, false},
    {"eth1", "10.1.0.3", false, false},  // down
};

std::string Pick(const std::string& spec, std::optional<std::string> route = std::nullopt) {
  const LocalInterface i = PickInterface(kHost, ParseInterfaceFilter(spec), route);
  return i.name + " " + i.address;
}

TEST(PickInterface, RouteInterfaceWinsWhenItMatchesElseFirstNonLoopback) {
  EXPECT_EQ(Pick("eth,ib", "192.168.1.3"), "ib0 192.168.1.3");
  EXPECT_EQ(Pick("eth,ib", "172.17.0.1"), "eth0 10.0.0.3");
  EXPECT_EQ(Pick("eth,ib"), "eth0 10.0.0.3");
  EXPECT_EQ(Pick("^docker,lo"), "eth0 10.0.0.3");
  EXPECT_EQ(Pick("^docker,eth"), "ib0 192.168.1.3");  // loopback only when nothing else matches
  EXPECT_EQ(Pick("=lo"), "lo 127.0.0.1");
  EXPECT_EQ(Pick("^=docker0", "172.17.0.1"), "eth0 10.0.0.3");
}

TEST(PickInterface, NothingMatchingListsTheInterfaces) {
  try {
    Pick("=eth1");  // down
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(std::string(e.what()),
              "network interface '=eth1': no interface of this host that is up and has an IPv4 "
              "address matches (interfaces here: lo 127.0.0.1, docker0 172.17.0.1, eth0 "
              "10.0.0.3, ib0 192.168.1.3, eth1 10.1.0.3 (down))");
  }
}

TEST(ChooseLocalInterface, LoopbackOnThisHost) {
  const LocalInterface lo = ChooseLocalInterface("=lo", "127.0.0.1", 29500);
  EXPECT_EQ(lo.name, "lo");
  EXPECT_EQ(lo.address, "127.0.0.1");
  const LocalInterface route = ChooseLocalInterface("", "127.0.0.1", 29500);
  EXPECT_EQ(route.address, "127.0.0.1");
  EXPECT_EQ(route.name, "lo");
}


TEST(ChooseLocalInterface, AFilterThatAdmitsNothingIsNamed) {
  try {
    ChooseLocalInterface("=nosuchif0", "127.0.0.1", 29500);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("network interface = '=nosuchif0' admits none"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace pipesgd::transport
