// The process tests/checkpoint/kill_test.py kills at random points while it saves.
//
//   checkpoint-kill-helper save DIR   saves forever on 2 ranks (threads): save n goes to
//                                     DIR/slot-{n % 2}, overwriting the one before the last;
//                                     prints "committed n" once save n returned
//   checkpoint-kill-helper verify DIR N   loads every DIR/slot-*: a slot must either load with
//                                     exactly the values of the step it records, or be refused
//                                     as incomplete; slot-{N % 2} (the last committed save) must
//                                     load with step N. Exit 0 when so, 1 otherwise (with why).
//
// Values: tensor k of step n holds rand(shape, seed n * 16 + k) under its placements: a
// function of (n, global index), so any rank checks its shard alone.
#include <fmt/format.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "checkpoint/checkpoint.h"
#include "collectives/local.h"
#include "kernels/error.h"

namespace {

using dtensor::DTensor;
using kernels::DType;

nn::StateDict make(const std::shared_ptr<const dtensor::MeshComms>& comms, int64_t step) {
  nn::StateDict sd;
  // About 6 MiB in all, on different placements, so a kill lands inside the writes.
  const std::vector<std::pair<dtensor::Dims, const char*>> shapes = {
      {{512, 1024}, "S(0)"}, {{1000, 513}, "S(1)"}, {{257, 33}, "R"}, {{64, 64}, "_S(0,2)"}};
  int k = 0;
  for (const auto& [shape, pl] : shapes) {
    sd.tensors.emplace_back(fmt::format("t{}", k),
                            dtensor::rand(shape, static_cast<uint64_t>(step * 16 + k), DType::kF32, comms,
                                          dtensor::parse_placements(pl)));
    ++k;
  }
  sd.values["step"] = step;
  return sd;
}

int verify(const std::string& dir, int64_t last) {
  int bad = 0;
  bool last_ok = last < 0;
  for (int slot = 0; slot < 2; ++slot) {
    const std::string path = fmt::format("{}/slot-{}", dir, slot);
    if (!std::filesystem::exists(path)) continue;
    std::string outcome;
    collectives::run_ranks(2, [&](collectives::Communicator& world) {
      auto comms = std::make_shared<dtensor::MeshComms>(dtensor::DeviceMesh::from_shape({2}), world);
      nn::StateDict target = make(comms, -1);
      std::string result;
      try {
        checkpoint::load(path, target, world);
        const int64_t step = target.int_value("step");
        const nn::StateDict expected = make(comms, step);
        for (size_t i = 0; i < target.tensors.size(); ++i) {
          const auto& a = target.tensors[i].second.to_local();
          const auto& b = expected.tensors[i].second.to_local();
          if (std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) != 0)
            result = fmt::format("WRONG DATA: {} loads with step {} but '{}' differs", path, step,
                                 target.tensors[i].first);
        }
        if (result.empty()) result = fmt::format("ok {}", step);
      } catch (const kernels::InvalidArgument& e) {
        const std::string m = e.what();
        result = m.find("incomplete") != std::string::npos ? "incomplete" : "ERROR: " + m;
      }
      if (world.rank() == 0) outcome = result;
    });
    std::printf("%s: %s\n", path.c_str(), outcome.c_str());
    if (outcome.rfind("ok ", 0) == 0) {
      const int64_t step = std::stoll(outcome.substr(3));
      if (step == last) last_ok = true;
      if (step % 2 != slot) {
        std::printf("  slot %d holds step %lld\n", slot, static_cast<long long>(step));
        ++bad;
      }
    } else if (outcome != "incomplete") {
      ++bad;
    }
  }
  if (!last_ok) {
    std::printf("the last committed save (step %lld) does not load\n", static_cast<long long>(last));
    ++bad;
  }
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 3 && std::string(argv[1]) == "save") {
      const std::string dir = argv[2];
      collectives::run_ranks(2, [&](collectives::Communicator& world) {
        auto comms = std::make_shared<dtensor::MeshComms>(dtensor::DeviceMesh::from_shape({2}), world);
        for (int64_t step = 1;; ++step) {
          checkpoint::save(fmt::format("{}/slot-{}", dir, step % 2), make(comms, step), world);
          if (world.rank() == 0) {
            std::printf("committed %lld\n", static_cast<long long>(step));
            std::fflush(stdout);
          }
        }
      });
      return 0;
    }
    if (argc == 4 && std::string(argv[1]) == "verify") return verify(argv[2], std::stoll(argv[3]));
    std::fprintf(stderr, "usage: checkpoint-kill-helper save DIR | verify DIR LAST\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint-kill-helper: %s\n", e.what());
    return 1;
  }
}
