#include "collectives/trace.h"

#include <algorithm>
#include <cstring>
#include <iterator>

#include "kernels/checked.h"
#include "kernels/error.h"

namespace collectives {

std::vector<kernels::TraceEvent> gather_trace(Communicator& world, const kernels::Tracer& tracer) {
  const std::vector<kernels::TraceEvent> mine = tracer.events();
  const std::string text = kernels::encode_trace(mine);
  const int n = world.size();
  Tensor size = Tensor::empty({1}, kernels::DType::kI64);
  size.data<int64_t>()[0] = static_cast<int64_t>(text.size());
  Tensor sizes = Tensor::empty({n}, kernels::DType::kI64);
  world.wait(world.all_gather(size, sizes));
  int64_t longest = 0;
  for (int i = 0; i < n; ++i) longest = std::max(longest, sizes.data<int64_t>()[i]);
  Tensor block = Tensor::zeros({std::max<int64_t>(longest, 1)}, kernels::DType::kU8);
  std::memcpy(block.data_ptr(), text.data(), text.size());
  Tensor all = Tensor::empty({kernels::checked_mul(static_cast<int64_t>(n), block.numel(), "trace gather bytes")},
                             kernels::DType::kU8);
  world.wait(world.all_gather(block, all));
  std::vector<kernels::TraceEvent> events;
  if (world.rank() != 0) return events;
  const char* base = static_cast<const char*>(all.data_ptr());
  for (int i = 0; i < n; ++i) {
    std::vector<kernels::TraceEvent> theirs =
        kernels::decode_trace({base + static_cast<size_t>(i) * static_cast<size_t>(block.numel()),
                               static_cast<size_t>(sizes.data<int64_t>()[i])});
    std::move(theirs.begin(), theirs.end(), std::back_inserter(events));
  }
  return events;
}

std::optional<kernels::File> create_trace_file(Communicator& world, const std::string& path) {
  std::optional<kernels::File> file;
  std::string why;
  if (world.rank() == 0) try {
      file = kernels::File::create(path);
    } catch (const kernels::Error& e) {
      why = e.what();
      if (why.empty()) why = "cannot create '" + path + "'";
    }
  Tensor ok = Tensor::empty({1}, kernels::DType::kI32);
  ok.data<int32_t>()[0] = why.empty() ? 1 : 0;
  world.wait(world.broadcast(ok, 0));
  if (ok.data<int32_t>()[0] == 0)
    throw kernels::InvalidArgument(world.rank() == 0 ? why : "rank 0 cannot create '" + path + "'");
  return file;
}

void write_trace(Communicator& world, const kernels::Tracer& tracer, std::optional<kernels::File>& file) {
  world.set_tracer(nullptr);
  const std::vector<kernels::TraceEvent> events = gather_trace(world, tracer);
  if (file) kernels::write_chrome_trace(*file, events);
}

}  // namespace collectives
