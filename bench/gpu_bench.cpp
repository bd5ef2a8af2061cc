// gpu-bench: the GPU's memory-bound kernels against the hardware, and a collective hidden behind
// compute. Run by tools/gpu-check.sh on a lent GPU; one JSON object per line on stdout.
//
//   gpu-bench kernels [--mib 256] [--dim 2048] [--world 8] [--iters 20] [--reps 5]
//     cudaMemcpy device-to-device of --mib MiB (the baseline), then copy_ f32->f32, cast f32->bf16,
//     chunk_cat (FSDP's copy-in of a dim --dim transformer block over --world ranks, f32) and
//     split_copy (its copy-out). One line each:
//       {"kernel":"cast f32->bf16","bytes":402653184,"us":152.1,"gbps":2647.0,"fraction":0.93,"ok":true}
//     bytes = read + written; fraction = gbps / the memcpy's gbps of the same run; ok: the output
//     equals the CPU kernel's, bit for bit. Times: median over --reps of (--iters calls, then one
//     synchronising 4-byte device-to-host copy) / --iters.
//   gpu-bench overlap [--mib 512] [--n 8192] [--iters 10] [--reps 5]
//     the nccl backend on one rank: an out-of-place all_reduce of --mib MiB (f32, on the
//     communicator's stream) issued, then a bf16 matmul [n,n]x[n,n] on the compute stream; one line
//       {"matmul_us":..,"all_reduce_us":..,"both_us":..,"hidden":0.97,"ok":true}
//     hidden = (matmul_us + all_reduce_us - both_us) / all_reduce_us, clipped to [0, 1]: 1 when
//     the collective is hidden entirely.
// Exit status: 0; 1 a wrong result; 2 bad options; 77 no usable GPU (skipped, "skipped: <why>").
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "collectives/nccl.h"
#include "kernels/checked.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/device.h"
#include "kernels/error.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"
#include "program/cli.h"
#include "program/main.h"
#include "program/stats.h"

using kernels::Device;
using kernels::DType;
using kernels::Tensor;

namespace {

struct Options {
  int64_t mib = 256;
  int64_t dim = 2048;
  int64_t world = 8;
  int64_t n = 8192;
  int iters = 20;
  int reps = 5;
};

const Device kGpu = Device::cuda(0);

// Waits for everything queued on the compute stream: a device-to-host copy is ordered after it.
void sync(const Tensor& probe) { (void)probe.narrow(0, 0, 1).to(Device::cpu()); }

// Median over reps of the time of one call, each rep timing `iters` calls then one sync.
double time_us(const Options& o, const Tensor& probe, const std::function<void()>& fn) {
  fn();
  sync(probe);
  std::vector<double> v;
  for (int r = 0; r < o.reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < o.iters; ++i) fn();
    sync(probe);
    v.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
                o.iters);
  }
  return program::median(v);
}

// A CPU tensor whose element i is a function of i (exact in bf16: small integers and halves).
Tensor indexed(const kernels::Dims& shape, DType dtype, int64_t salt) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  float* p = t.data<float>();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>((i * 7 + salt) % 509) * 0.5f - 64.0f;
  return dtype == DType::kF32 ? t : t.to(dtype);
}

bool same_bytes(const Tensor& gpu, const Tensor& cpu) {
  const Tensor h = gpu.to(Device::cpu()).contiguous();
  const Tensor c = cpu.contiguous();
  return h.dtype() == c.dtype() && h.numel() == c.numel() &&
         std::memcmp(h.data_ptr(), c.data_ptr(), h.nbytes()) == 0;
}

// One transformer block's parameter shapes (LayerNorms, q/k/v/o, MLP 4D; as fsdp-train's GPT).
std::vector<kernels::Dims> block_shapes(int64_t d) {
  std::vector<kernels::Dims> s = {{d}, {d}};
  for (int i = 0; i < 4; ++i) s.push_back({d, d});
  s.push_back({d});
  s.push_back({d});
  s.push_back({4 * d, d});
  s.push_back({d, 4 * d});
  return s;
}

int run_kernels(const Options& o) {
  const int64_t n = kernels::checked_mul(o.mib, int64_t{1} << 18, "--mib elements");  // f32 count
  const Tensor src_cpu = indexed({n}, DType::kF32, 1);
  const Tensor src = src_cpu.to(kGpu);
  Tensor dst = Tensor::empty({n}, DType::kF32, kGpu);
  Tensor dst16 = Tensor::empty({n}, DType::kBF16, kGpu);
  int status = program::kOk;
  double base_gbps = 0;
  auto report = [&](const std::string& name, double bytes, double us, bool ok) {
    const double gbps = bytes / us / 1e3;
    if (base_gbps == 0) base_gbps = gbps;
    fmt::print("{{\"kernel\":\"{}\",\"bytes\":{:.0f},\"us\":{:.1f},\"gbps\":{:.1f},\"fraction\":{:.3f},\"ok\":{}}}\n",
               name, bytes, us, gbps, gbps / base_gbps, ok);
    std::fflush(stdout);
    if (!ok) status = program::kMismatch;
  };
  const double nb = static_cast<double>(src.nbytes());
  const double memcpy_us = time_us(o, src, [&] {
    kernels::detail::cuda_memcpy(dst.data_ptr(), kGpu, src.data_ptr(), kGpu, src.nbytes());
  });
  report("cudaMemcpy d2d f32", 2 * nb, memcpy_us, same_bytes(dst, src_cpu));
  dst.fill_(0.0);
  report("copy f32->f32", 2 * nb, time_us(o, src, [&] { dst.copy_(src); }), same_bytes(dst, src_cpu));
  report("cast f32->bf16", 1.5 * nb, time_us(o, src, [&] { dst16.copy_(src); }),
         same_bytes(dst16, src_cpu.to(DType::kBF16)));

  const std::vector<kernels::Dims> shapes = block_shapes(o.dim);
  const kernels::ChunkCatLayout layout(shapes, o.world);
  std::vector<Tensor> params_cpu, params, outs;
  int64_t numel = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    params_cpu.push_back(indexed(shapes[i], DType::kF32, static_cast<int64_t>(i)));
    params.push_back(params_cpu.back().to(kGpu));
    outs.push_back(Tensor::empty(shapes[i], DType::kF32, kGpu));
    numel += shapes[i].product();
  }
  const double pb = 8.0 * static_cast<double>(numel);  // f32 read + f32 written
  Tensor flat_cpu = Tensor::empty({layout.numel()}, DType::kF32);
  kernels::chunk_cat(flat_cpu, params_cpu, layout);
  Tensor flat = Tensor::empty({layout.numel()}, DType::kF32, kGpu);
  report(fmt::format("chunk_cat f32 dim {} world {}", o.dim, o.world), pb,
         time_us(o, src, [&] { kernels::chunk_cat(flat, params, layout); }), same_bytes(flat, flat_cpu));
  const Tensor flat_in = flat_cpu.to(kGpu);
  bool ok = true;
  const double split_us = time_us(o, src, [&] { kernels::split_copy(outs, flat_in, layout); });
  for (size_t i = 0; i < shapes.size(); ++i) ok = ok && same_bytes(outs[i], params_cpu[i]);
  report(fmt::format("split_copy f32 dim {} world {}", o.dim, o.world), pb, split_us, ok);
  return status;
}

int run_overlap(const Options& o) {
  if (!collectives::nccl_built()) throw kernels::Unsupported("gpu-bench overlap: this build has no NCCL");
  const int64_t n = kernels::checked_mul(o.mib, int64_t{1} << 18, "--mib elements");
  int status = program::kOk;
  collectives::run_ranks(1, [&](collectives::Communicator& world) {
    auto nccl = collectives::nccl_communicator(world, 0);
    const Tensor x_cpu = indexed({n}, DType::kF32, 3);
    const Tensor x = x_cpu.to(kGpu);
    Tensor y = Tensor::empty({n}, DType::kF32, kGpu);
    const Tensor a = indexed({o.n, o.n}, DType::kBF16, 5).to(kGpu);
    const Tensor b = indexed({o.n, o.n}, DType::kBF16, 6).to(kGpu);
    Tensor c = Tensor::empty({o.n, o.n}, DType::kBF16, kGpu);
    const double mm = time_us(o, x, [&] { kernels::matmul_out(c, a, b); });
    const double ar = time_us(o, x, [&] { nccl->wait(nccl->all_reduce(x, y, kernels::ReduceOp::kSum)); });
    const double both = time_us(o, x, [&] {
      auto w = nccl->all_reduce(x, y, kernels::ReduceOp::kSum);
      kernels::matmul_out(c, a, b);
      nccl->wait(w);
    });
    const bool ok = same_bytes(y, x_cpu);
    const double hidden = std::clamp((mm + ar - both) / ar, 0.0, 1.0);
    fmt::print("{{\"matmul_us\":{:.1f},\"all_reduce_us\":{:.1f},\"both_us\":{:.1f},\"hidden\":{:.3f},\"ok\":{}}}\n", mm,
               ar, both, hidden, ok);
    if (!ok) status = program::kMismatch;
  });
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  return program::run("gpu-bench", [&] {
    CLI::App app{"gpu-bench: memory-bound GPU kernels against cudaMemcpy, and compute/communication overlap"};
    Options o;
    app.require_subcommand(1);
    CLI::App* k = app.add_subcommand("kernels", "copy / cast / chunk_cat / split_copy as a fraction of cudaMemcpy");
    k->add_option("--mib", o.mib, "MiB of f32 for copy and cast (default 256)");
    k->add_option("--dim", o.dim, "transformer block dim for chunk_cat / split_copy (default 2048)");
    k->add_option("--world", o.world, "ranks of the chunk_cat layout (default 8)");
    CLI::App* ov = app.add_subcommand("overlap", "an nccl all_reduce hidden behind a matmul (one rank)");
    ov->add_option("--mib", o.mib, "MiB of f32 all-reduced (default 512 here)");
    ov->add_option("--n", o.n, "matmul size (default 8192)");
    for (CLI::App* s : {k, ov}) {
      s->add_option("--iters", o.iters, "calls per timed repetition (default 20)");
      s->add_option("--reps", o.reps, "timed repetitions, median reported (default 5)");
    }
    program::parse(app, argc, argv);
    if (ov->parsed() && ov->count("--mib") == 0) o.mib = 512;
    if (ov->parsed() && ov->count("--iters") == 0) o.iters = 10;
    if (o.mib < 1 || o.mib > 65536) throw kernels::InvalidArgument(fmt::format("--mib {}: expected 1..65536", o.mib));
    if (o.dim < 1 || o.dim > 65536) throw kernels::InvalidArgument(fmt::format("--dim {}: expected 1..65536", o.dim));
    if (o.world < 1 || o.world > 1024)
      throw kernels::InvalidArgument(fmt::format("--world {}: expected 1..1024", o.world));
    if (o.n < 1 || o.n > 65536) throw kernels::InvalidArgument(fmt::format("--n {}: expected 1..65536", o.n));
    if (o.iters < 1 || o.iters > 100000)
      throw kernels::InvalidArgument(fmt::format("--iters {}: expected 1..100000", o.iters));
    if (o.reps < 1 || o.reps > 1000) throw kernels::InvalidArgument(fmt::format("--reps {}: expected 1..1000", o.reps));
    if (kernels::cuda_device_count() < 1) {
      std::printf("skipped: %s\n", kernels::cuda_built() ? "built with CUDA but no GPU is usable on this machine"
                                                         : "this build has no CUDA");
      return 77;
    }
    return k->parsed() ? run_kernels(o) : run_overlap(o);
  });
}
