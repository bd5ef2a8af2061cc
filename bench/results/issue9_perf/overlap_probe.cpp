// Usage: overlap_probe WORLD BYTES_PER_RANK [ITERS] [SLEEP_MULT]; PREIDLE=us sleeps that long before each
// back-to-back call (the cold-start check of RESULTS.md). Build as raw_latency.cpp.
// Overlap probe: N ranks, all_gather of B bytes per rank. fg = issue+wait; bg = issue, kick, sleep(fg), wait;
// a host task after the call records when the worker finished it (end), one before it when the worker started (start).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#include "collectives/local.h"
#include "kernels/tensor.h"
using namespace collectives;
using kernels::Tensor;
using C = std::chrono::steady_clock;
static double us(C::time_point a, C::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }
static double med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
int main(int argc, char** argv) {
  int n = atoi(argv[1]); long bytes = atol(argv[2]); int iters = argc > 3 ? atoi(argv[3]) : 15; double mult = argc > 4 ? atof(argv[4]) : 1.0;
  std::vector<std::vector<double>> fg(n), bg(n), st(n), en(n);
  run_ranks(n, [&](Communicator& w) {


    Communicator& cm = w;
    int r = cm.rank();
    Tensor in = Tensor::empty({bytes / 4}, kernels::DType::kF32), out = Tensor::empty({n * bytes / 4}, kernels::DType::kF32);
    for (int i = 0; i < 3; ++i) cm.wait(cm.all_gather(in, out));
    for (int i = 0; i < iters; ++i) { if (getenv("PREIDLE")) std::this_thread::sleep_for(std::chrono::microseconds(atoi(getenv("PREIDLE")))); cm.wait(cm.barrier()); auto t0 = C::now(); cm.wait(cm.all_gather(in, out)); fg[r].push_back(us(t0, C::now())); }
    double T = med(fg[r]);
    for (int i = 0; i < iters; ++i) {
      cm.wait(cm.barrier());
      C::time_point t0 = C::now(), ts{}, te{};
      auto h0 = cm.host_task([&] { ts = C::now(); });
      auto h = cm.all_gather(in, out);
      auto h2 = cm.host_task([&] { te = C::now(); });
      cm.kick();
      std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(T * mult));
      cm.wait(h2);
      bg[r].push_back(us(t0, C::now())); st[r].push_back(us(t0, ts)); en[r].push_back(us(t0, te));
    }
  }, Milliseconds{60000});
  for (int r = 0; r < n; ++r) printf("rank %d: fg %.0f  bg %.0f  worker start %.0f  worker end %.0f\n", r, med(fg[r]), med(bg[r]), med(st[r]), med(en[r]));
}
