// Build against any tree (here: a release build in BUILD):
//   c++ -std=c++20 -O2 -DNDEBUG -I. raw_latency.cpp BUILD/collectives/libcollectives.a BUILD/kernels/libkernels*.a \
//       -lfmt -lpthread -o lat    (trees before 0b9d392 have only libkernels.a)
//   chrt -f 10 ./lat 4 2000 7 32
// Raw local all_gather latency: per repeat, barrier then CALLS x (all_gather + wait); us per call,
// max over ranks, median over repeats. Usage: lat WORLD [CALLS] [REPEATS] [BYTES_PER_RANK]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>
#include "collectives/local.h"
#include "kernels/tensor.h"
using namespace collectives;
using kernels::Tensor;
int main(int argc, char** argv) {
  int n = argc > 1 ? atoi(argv[1]) : 4, calls = argc > 2 ? atoi(argv[2]) : 2000, reps = argc > 3 ? atoi(argv[3]) : 15;
  long bytes = argc > 4 ? atol(argv[4]) : 32;
  std::vector<std::vector<double>> t(reps, std::vector<double>(n));
  run_ranks(n, [&](Communicator& c) {
    Tensor in = Tensor::empty({bytes / 4}, kernels::DType::kF32), out = Tensor::empty({n * bytes / 4}, kernels::DType::kF32);
    for (int w = 0; w < 3 + reps; ++w) {
      c.wait(c.barrier());
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < calls; ++i) c.wait(c.all_gather(in, out));
      auto t1 = std::chrono::steady_clock::now();
      if (w >= 3) t[w - 3][c.rank()] = std::chrono::duration<double, std::micro>(t1 - t0).count() / calls;
    }
  }, Milliseconds{60000});
  std::vector<double> m;
  for (auto& r : t) m.push_back(*std::max_element(r.begin(), r.end()));
  std::sort(m.begin(), m.end());
  printf("world %d: %.3f us per all_gather (min %.3f max %.3f)\n", n, m[m.size() / 2], m.front(), m.back());
}
