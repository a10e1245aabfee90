// Rendezvous: every rank learns every address; a misconfigured job (different job description,
// duplicate rank, other world size) fails on every rank with an error naming the culprit; a
// rank that never comes is named; a stranger on the port is dropped without hurting the job.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

#include <fmt/format.h>

#include "core/base/error.h"
#include "core/base/log.h"
#include "tests/support/multiproc.h"
#include "transport/auth.h"
#include "transport/message_io.h"
#include "transport/rendezvous.h"
#include "transport/wire.pb.h"

namespace pipesgd {
namespace {

using testing::RankContext;
using testing::RunRanks;
using transport::RendezvousAllGather;
using transport::RendezvousOptions;

RendezvousOptions Options(const RankContext& ctx, std::string job = "job A\n") {
  return {"127.0.0.1", ctx.master_port, ctx.rank, ctx.world_size, std::move(job), ""};
}

std::string Joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + ";";
  return s;
}

TEST(Rendezvous, EveryRankGetsEveryAddress) {
  auto results = RunRanks(5, [](const RankContext& ctx) {
    return Joined(RendezvousAllGather(Options(ctx), "addr" + std::to_string(ctx.rank),
                                      Deadline::After(20)));
  });
  for (int r = 0; r < 5; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output, "addr0;addr1;addr2;addr3;addr4;");
  }
}

// Rendezvous after rendezvous on one port (tests and tools that build two rings): a rank that
// got its answer early starts the next round while rank 0 is still answering the others. Its
// hello must reach the next round's listener, never the closing one (which once either failed
// the job with "joined twice" or dropped the rank, so the next round timed out naming it).
TEST(Rendezvous, BackToBackRoundsOnOnePortStayApart) {
  constexpr int kRounds = 40;
  auto results = RunRanks(4, [](const RankContext& ctx) {
    std::string out;
    for (int round = 0; round < kRounds; ++round) {
      out += Joined(RendezvousAllGather(Options(ctx), fmt::format("r{}.{}", ctx.rank, round),
                                        Deadline::After(20)));
      out += "|";
    }
    return out;
  });
  std::string want;
  for (int round = 0; round < kRounds; ++round) {
    want += fmt::format("r0.{0};r1.{0};r2.{0};r3.{0};|", round);
  }
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, want) << "rank " << r;
  }
}

TEST(Rendezvous, RanksMayStartLate) {
  auto results = RunRanks(3, [](const RankContext& ctx) {
    if (ctx.rank == 0) std::this_thread::sleep_for(std::chrono::seconds(2));  // others retry
    return Joined(RendezvousAllGather(Options(ctx), std::to_string(ctx.rank), Deadline::After(10)));
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output, "0;1;2;");
  }
}

TEST(Rendezvous, DifferentJobIsRejectedOnEveryRankNamingTheLine) {
  auto results = RunRanks(3, [](const RankContext& ctx) {
    std::string job = "pipesgd 0.1.0\ntrain {\n  batch_size: 16\n  pipeline_width: " +
                      std::string(ctx.rank == 2 ? "1" : "2") + "\n}\n";
    RendezvousAllGather(Options(ctx, job), "a", Deadline::After(20));
    return std::string("no error");
  });
  const std::string expected =
      "rank 2 (from 127.0.0.1:";  // then the port, then:
  const std::string difference =
      "was started with a different job than rank 0: in train: rank 2 has `pipeline_width: 1`, "
      "rank 0 has `pipeline_width: 2`";
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].exit_code, 1) << "rank " << r << ": " << results[r].output;
    EXPECT_NE(results[r].error.find(expected), std::string::npos) << results[r].error;
    EXPECT_NE(results[r].error.find(difference), std::string::npos) << results[r].error;
  }
}

TEST(Rendezvous, DuplicateRankIsRejected) {
  auto results = RunRanks(3, [](const RankContext& ctx) {
    RankContext c = ctx;
    if (c.rank == 2) c.rank = 1;  // two processes claim rank 1
    RendezvousAllGather(Options(c), "a", Deadline::After(20));
    return std::string("no error");
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].exit_code, 1) << "rank " << r;
    EXPECT_NE(results[r].error.find("rank 1 joined twice"), std::string::npos) << results[r].error;
  }
}

TEST(Rendezvous, WorldSizeMismatchIsRejected) {
  auto results = RunRanks(2, [](const RankContext& ctx) {
    RankContext c = ctx;
    if (c.rank == 1) c.world_size = 3;
    RendezvousAllGather(Options(c), "a", Deadline::After(20));
    return std::string("no error");
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].exit_code, 1);
    EXPECT_NE(results[r].error.find("was started with WORLD_SIZE=3, rank 0 with 2"),
              std::string::npos)
        << results[r].error;
  }
}

TEST(Rendezvous, MissingRanksAreNamedOnTimeout) {
  // WORLD_SIZE 4 but only ranks 0 and 2 start.
  auto results = RunRanks(2, [](const RankContext& ctx) {
    RankContext c = ctx;
    c.world_size = 4;
    c.rank = ctx.rank * 2;
    RendezvousAllGather(Options(c), "a", Deadline::After(c.rank == 0 ? 2 : 4));
    return std::string("no error");
  });
  EXPECT_EQ(results[0].exit_code, 1);
  EXPECT_NE(results[0].error.find("rank(s) 1, 3 never arrived (world size 4, 2 arrived)"),
            std::string::npos)
      << results[0].error;
  EXPECT_EQ(results[1].exit_code, 1);
  EXPECT_NE(results[1].error.find("never arrived"), std::string::npos) << results[1].error;
}

TEST(Rendezvous, StrangerOnThePortIsDroppedAndTheJobCarriesOn) {
  auto results = RunRanks(3, [](const RankContext& ctx) {
    if (ctx.rank == 2) {
      // Not a pipesgd rank: garbage, then an oversized frame header. Then join for real.
      for (const std::string& junk : {std::string("GET / HTTP/1.0\r\n\r\n"),
                                      std::string("PSGM\xff\xff\xff\x7f", 8)}) {
        int fd = -1;
        for (int i = 0; i < 100; ++i) {
          fd = socket(AF_INET, SOCK_STREAM, 0);
          sockaddr_in a{};
          a.sin_family = AF_INET;
          a.sin_port = htons(ctx.master_port);
          a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
          if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) break;
          close(fd);
          fd = -1;
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        if (fd < 0) throw std::runtime_error("cannot reach rank 0");
        (void)!write(fd, junk.data(), junk.size());
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        close(fd);
      }
    }
    return Joined(RendezvousAllGather(Options(ctx), std::to_string(ctx.rank), Deadline::After(10)));
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output, "0;1;2;");
  }
}

RendezvousOptions WithToken(const RankContext& ctx, int rank, std::string token) {
  RendezvousOptions o = Options(ctx);
  o.rank = rank;
  o.token = std::move(token);
  return o;
}

std::string ErrorOf(const RendezvousOptions& options) {
  try {
    RendezvousAllGather(options, "intruder", Deadline::After(10));
  } catch (const Error& e) {
    return fmt::format("{}: {}", static_cast<int>(e.code()), e.what());
  }
  return "no error";
}

// A job started with a token (as `pipesgd run` does): a process without it, or with another
// job's, is turned away and logged by rank 0, cannot take a rank or fail the job, and the job
// completes with the real ranks.
TEST(Rendezvous, ConnectionWithoutTheTokenIsRefusedLoggedAndTheJobCarriesOn) {
  const std::string token = "0123456789abcdef0123456789abcdef";
  auto results = RunRanks(3, [&](const RankContext& ctx) {
    std::string log;
    std::string refusals;
    if (ctx.rank == 2) {
      // Claims rank 1 with no token, then rank 1 again with another job's token, then world
      // size 7 (which, authenticated, would fail the whole job).
      RendezvousOptions none = WithToken(ctx, 1, "");
      RendezvousOptions wrong = WithToken(ctx, 1, "fedcba9876543210fedcba9876543210");
      RendezvousOptions bad_world = WithToken(ctx, 1, "");
      bad_world.world_size = 7;
      refusals = ErrorOf(none) + "\n" + ErrorOf(wrong) + "\n" + ErrorOf(bad_world) + "\n";
    }
    char path[] = "/tmp/pipesgd_rdv_log_XXXXXX";
    int saved = -1;
    if (ctx.rank == 0) {
      InitLogging();
      const int fd = mkstemp(path);
      saved = dup(STDERR_FILENO);
      dup2(fd, STDERR_FILENO);
      close(fd);
    }
    std::string addresses = Joined(RendezvousAllGather(WithToken(ctx, ctx.rank, token),
                                                       std::to_string(ctx.rank),
                                                       Deadline::After(20)));
    if (ctx.rank == 0) {
      dup2(saved, STDERR_FILENO);
      std::ifstream in(path);
      log.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      unlink(path);
    }
    return addresses + "\n" + refusals + log;
  });
  for (int r = 0; r < 3; ++r) ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
  EXPECT_EQ(results[1].output, "0;1;2;\n");
  const std::string& out2 = results[2].output;
  EXPECT_EQ(out2.substr(0, 7), "0;1;2;\n");
  // kInvalidArgument (code 0), naming rank 0 and why, once per attempt. Without a token the
  // intruder is refused by rank 0; with another job's token it stops itself, because rank 0
  // cannot prove that token, and sends nothing of its job.
  size_t at = 7;
  const std::string refused = "0: rank 1: rank 0 at 127.0.0.1:";
  const std::vector<std::string> why = {
      " refused this process: it presented no job token (PIPESGD_JOB_TOKEN must be that of the "
      "job; `pipesgd run` sets it)",
      " did not prove that it knows this job's token: it is not this job's rank 0 (another "
      "program or another job on that port, or this rank's PIPESGD_JOB_TOKEN is not the job's); "
      "nothing of the job was sent to it",
      " refused this process: it presented no job token"};
  for (int i = 0; i < 3; ++i) {
    const size_t end = out2.find('\n', at);
    ASSERT_NE(end, std::string::npos) << out2;
    const std::string line = out2.substr(at, end - at);
    const std::string start = i == 1 ? "0: rank 1: the process listening at rank 0 at 127.0.0.1:"
                                     : refused;
    EXPECT_EQ(line.substr(0, start.size()), start) << line;
    EXPECT_NE(line.find(why[i]), std::string::npos) << line;
    at = end + 1;
  }
  // Rank 0 logged each one, naming where it came from (and, when it got that far, the rank it
  // claimed).
  const std::string& out0 = results[0].output;
  EXPECT_EQ(out0.substr(0, 7), "0;1;2;\n") << out0;
  size_t logged = 0;
  for (size_t p = out0.find("warning: rank 0: rendezvous refused a connection from 127.0.0.1:");
       p != std::string::npos;
       p = out0.find("warning: rank 0: rendezvous refused a connection from 127.0.0.1:", p + 1)) {
    ++logged;
  }
  EXPECT_EQ(logged, 2u) << out0;
  EXPECT_NE(out0.find("(claiming rank 1): it presented no job token; the job carries on without "
                      "it"),
            std::string::npos)
      << out0;
  EXPECT_NE(out0.find("it left the handshake after the rendezvous's proof of the job token: it "
                      "holds another job's token, or none"),
            std::string::npos)
      << out0;
}

// Started by hand without PIPESGD_JOB_TOKEN on any rank: an unauthenticated rendezvous.
TEST(Rendezvous, WithoutATokenAnywhereEveryHelloIsHeard) {
  auto results = RunRanks(3, [](const RankContext& ctx) {
    return Joined(RendezvousAllGather(WithToken(ctx, ctx.rank, ""), std::to_string(ctx.rank),
                                      Deadline::After(20)));
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output, "0;1;2;");
  }
}

// A rank with a token never talks to a rank 0 that cannot prove it, even one without any token
// (which would hear anyone): it stops at once, naming what it found, and sends nothing of its job.
TEST(Rendezvous, RankWithATokenRefusesARank0WithoutOne) {
  auto results = RunRanks(2, [](const RankContext& ctx) {
    return Joined(RendezvousAllGather(WithToken(ctx, ctx.rank, ctx.rank == 0 ? "" : "t"),
                                      std::to_string(ctx.rank),
                                      Deadline::After(ctx.rank == 0 ? 3 : 20)));
  });
  EXPECT_EQ(results[1].exit_code, 1);
  EXPECT_NE(results[1].error.find("the process listening at rank 0 at 127.0.0.1:"),
            std::string::npos)
      << results[1].error;
  EXPECT_NE(results[1].error.find("runs without a job token, and this rank has one"),
            std::string::npos)
      << results[1].error;
  EXPECT_EQ(results[0].exit_code, 1);
  EXPECT_NE(results[0].error.find("rank(s) 1 never arrived"), std::string::npos)
      << results[0].error;
}

// A process that is not this job's rank 0 holds the port (another program, another job). It
// must learn neither the token nor the job (config, address): silent, echoing everything back,
// or speaking the handshake with a proof it cannot make.
enum class Foreign { kSilent, kEcho, kFakeChallenge };

std::string ReadSome(int fd, double seconds) {
  std::string got;
  timeval tv{static_cast<time_t>(seconds), 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) got.append(buf, static_cast<size_t>(n));
  return got;
}

std::string Frame(const google::protobuf::MessageLite& m) {
  const std::string body = m.SerializeAsString();
  std::string f(8, '\0');
  const uint32_t magic = transport::kMessageMagic, n = static_cast<uint32_t>(body.size());
  std::memcpy(f.data(), &magic, 4);
  std::memcpy(f.data() + 4, &n, 4);
  return f + body;
}

TEST(Rendezvous, AForeignListenerOnThePortLearnsNeitherTheTokenNorTheJob) {
  const std::string token = "5ecre7-5ecre7-5ecre7-5ecre7-5ecre7";
  const std::string job = "train { learning_rate: 0.0123456 }  # distinctive config text\n";
  const std::string address = "published-address-of-rank-1";
  for (Foreign kind : {Foreign::kSilent, Foreign::kEcho, Foreign::kFakeChallenge}) {
    uint16_t port = 0;
    const int listener = testing::ListenOnLoopback(&port);
    std::string received;
    std::thread server([&] {
      const int fd = accept(listener, nullptr, nullptr);
      if (kind == Foreign::kSilent) {
        received = ReadSome(fd, 3);
      } else if (kind == Foreign::kEcho) {
        char buf[4096];
        timeval tv{3, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        ssize_t n;
        while ((n = read(fd, buf, sizeof(buf))) > 0) {
          received.append(buf, static_cast<size_t>(n));
          (void)!write(fd, buf, static_cast<size_t>(n));
        }
      } else {
        char header[8];
        ASSERT_EQ(read(fd, header, 8), 8);
        uint32_t n = 0;
        std::memcpy(&n, header + 4, 4);
        std::string body(n, '\0');
        ASSERT_EQ(read(fd, body.data(), n), static_cast<ssize_t>(n));
        received.append(header, 8);
        received += body;
        wire::AuthChallenge challenge;
        challenge.set_protocol_version(transport::kProtocolVersion);
        challenge.set_nonce(transport::RandomBytes(32));
        challenge.set_proof(transport::RandomBytes(32));
        const std::string f = Frame(challenge);
        (void)!write(fd, f.data(), f.size());
        received += ReadSome(fd, 3);
      }
      close(fd);
    });
    RendezvousOptions o{"127.0.0.1", port, 1, 2, job, token};
    std::string error = "no error";
    try {
      RendezvousAllGather(o, address, Deadline::After(2));
    } catch (const Error& e) {
      error = e.what();
    }
    server.join();
    close(listener);
    SCOPED_TRACE(static_cast<int>(kind));
    EXPECT_NE(error, "no error");
    EXPECT_EQ(received.find(token), std::string::npos);
    EXPECT_EQ(received.find("0.0123456"), std::string::npos);
    EXPECT_EQ(received.find(address), std::string::npos);
    // What it did receive: one AuthOpen (a nonce, our rank, the service name), nothing else.
    EXPECT_LT(received.size(), 80u) << received.size();
    if (kind == Foreign::kFakeChallenge) {
      EXPECT_NE(error.find("did not prove that it knows this job's token: it is not this job's "
                           "rank 0"),
                std::string::npos)
          << error;
    }
  }
}

TEST(TokenProof, IsHmacSha256OfTheLengthPrefixedFieldsAndComparesInConstantTime) {
  // Known answer, computed independently: python3 -c 'import hmac,hashlib,struct;
  // f=lambda *a: b"".join(struct.pack("<I",len(x))+x for x in a);
  // print(hmac.new(b"key", f(b"server",b"rendezvous",b"A",b"B",b""), hashlib.sha256).hexdigest())'
  const std::string proof = transport::TokenProof("key", "server", "rendezvous", "A", "B");
  std::string hex;
  for (unsigned char c : proof) hex += fmt::format("{:02x}", c);
  EXPECT_EQ(hex, "6cc7a524d1e56d0cbeefcfc3f7754b25712fd0345d60d16a28c4bd0dbbff9217");
  EXPECT_EQ(transport::TokenProof("", "server", "rendezvous", "A", "B"), "");
  // The roles and the order of the nonces matter: no proof can be reflected or replayed.
  EXPECT_NE(proof, transport::TokenProof("key", "client", "rendezvous", "A", "B"));
  EXPECT_NE(proof, transport::TokenProof("key", "server", "rendezvous", "B", "A"));
  EXPECT_NE(proof, transport::TokenProof("key", "server", "group scheduler", "A", "B"));
  EXPECT_TRUE(transport::SameProof(proof, proof));
  EXPECT_FALSE(transport::SameProof(proof, proof.substr(1)));
  EXPECT_EQ(transport::RandomBytes(32).size(), 32u);
  EXPECT_NE(transport::RandomBytes(32), transport::RandomBytes(32));
}

TEST(IsLoopbackIp, BothFamiliesAndIpv4Mapped) {
  for (const char* ip : {"127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1"}) {
    EXPECT_TRUE(transport::IsLoopbackIp(ip)) << ip;
  }
  for (const char* ip : {"10.0.0.1", "fd00::2", "::ffff:10.0.0.1", "localhost", ""}) {
    EXPECT_FALSE(transport::IsLoopbackIp(ip)) << ip;
  }
}

TEST(DescribeJobDifference, NamesTheSectionAndBothLines) {
  const std::string a = "v1\nmodel {\n  layers {\n    linear {\n      out_features: 256\n    }\n  }\n}\n";
  const std::string b = "v1\nmodel {\n  layers {\n    linear {\n      out_features: 255\n    }\n  }\n}\n";
  EXPECT_EQ(transport::DescribeJobDifference(a, 3, b, 0),
            "in model.layers.linear: rank 3 has `out_features: 256`, rank 0 has "
            "`out_features: 255`");
  EXPECT_EQ(transport::DescribeJobDifference("v1\n", 1, "v2\n", 0),
            "in line 1: rank 1 has `v1`, rank 0 has `v2`");
  EXPECT_EQ(transport::DescribeJobDifference("x\n", 1, "x\ny\n", 0),
            "in line 2: rank 1 has ``, rank 0 has `y`");
}

}  // namespace
}  // namespace pipesgd
