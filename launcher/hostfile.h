// Host lists for `pipesgd run` as users of mpirun already write them:
//   -H lab0:2,lab1,lab2:1        host[:slots], comma separated (slots default to 1)
//   --hostfile FILE              Open MPI lines: "host [slots=N] [max_slots=M]", '#' comments,
//                                blank lines; a host listed twice adds its slots
// Ranks fill the hosts in order, slot by slot (Open MPI's --map-by slot): with -H a:2,b:2 and
// -np 3, ranks 0 and 1 run on a and rank 2 on b.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace pipesgd::launcher {

struct HostSlots {
  std::string host;  // as written: an ssh destination (name, alias of an ssh config, address)
  int slots = 1;     // >= 1
};

// Parses "host[:slots],..." (repeated -H options may be joined with commas). Throws Error
// kInvalidArgument naming the entry: empty, bad characters, slots not an integer in [1, 4096].
std::vector<HostSlots> ParseHostList(std::string_view spec);

// Parses the text of an Open MPI hostfile; `path` names it in errors, which carry the line
// number ("hosts.txt:3: slots=0: expected an integer in [1, 4096]"). Keys: slots (also count,
// cpu), max_slots (>= slots; accepted, not otherwise used). An unknown key, a bad host or a file
// without any host is an error.
std::vector<HostSlots> ParseHostfile(std::string_view text, const std::string& path);

// Reads and parses a hostfile. Throws kNotFound if it cannot be read, else as ParseHostfile.
std::vector<HostSlots> ReadHostfile(const std::string& path);

// Where each rank runs.
struct Placement {
  int rank = 0;
  std::string host;
  int local_rank = 0;        // index among the ranks on the same host
  int local_world_size = 1;  // ranks on the same host
};

// Places `np` ranks on the hosts, slot by slot in order. Throws Error kInvalidArgument when np
// exceeds the slots ("-np 6 but the hosts have 4 slots in all (lab0:1, ...)") or np < 1.
std::vector<Placement> PlaceRanks(const std::vector<HostSlots>& hosts, int np);

// Total slots of the list.
int TotalSlots(const std::vector<HostSlots>& hosts);

}  // namespace pipesgd::launcher
