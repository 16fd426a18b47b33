// The benchmark shapes of bench/bench_configs.json (a copy of the project's shared list).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sonicmoe::tools {

struct BenchConfig {
  std::string name;
  std::int64_t T = 0, H = 0, I = 0, E = 0, K = 0;
  std::vector<std::string> routing;  // empty: top-K only
  std::int64_t tile = 128;
};

// Parses the file; throws sonicmoe::Error naming the file and the problem.
std::vector<BenchConfig> load_bench_configs(const std::string& path);

}  // namespace sonicmoe::tools
