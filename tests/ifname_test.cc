// NCCL_SOCKET_IFNAME grammar (transport/ifname.h): prefixes, ^ to exclude, = for exact names,
// errors naming the spec, and which interface a rank picks from a host's list.
#include <gtest/gtest.h>

#include "core/base/error.h"
#include "transport/ifname.h"

namespace pipesgd::transport {
namespace {

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

}  // namespace
}  // namespace pipesgd::transport
