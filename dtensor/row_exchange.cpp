#include "dtensor/row_exchange.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kernels/checked.h"
#include "kernels/error.h"

namespace dtensor {

using kernels::InvalidArgument;
using kernels::Tensor;

namespace {

int64_t checked_total(std::span<const int64_t> counts, int members, const char* what) {
  if (static_cast<int>(counts.size()) != members)
    throw InvalidArgument(fmt::format("exchange_rows: {} {} for {} members (expected one per member)",
                                      counts.size(), what, members));
  int64_t total = 0;
  for (int64_t c : counts) {
    if (c < 0) throw InvalidArgument(fmt::format("exchange_rows: {} {} has a negative count", what, counts));
    total = kernels::checked_add(total, c, "row count");
  }
  return total;
}

}  // namespace

Tensor RowExchangeHandle::wait() {
  if (!work_) throw InvalidArgument("RowExchangeHandle::wait: no exchange in flight");
  comm_->wait(work_);
  work_.reset();
  counts_.reset();
  return out_;
}

RowExchangeHandle exchange_rows_known(const MeshComms& comms, int mesh_dim, const Tensor& rows,
                                      std::span<const int64_t> send_rows, std::span<const int64_t> recv_rows,
                                      std::string_view label) {
  collectives::Communicator& comm = comms.dim(mesh_dim);
  const collectives::TraceLabel trace_label(comm, [&] { return std::string(label); });
  if (rows.ndim() != 2 || !rows.is_contiguous())
    throw InvalidArgument(fmt::format("exchange_rows: rows of shape {} (expected a contiguous [n, width])",
                                      rows.shape()));
  const int64_t width = rows.size(1);
  if (checked_total(send_rows, comm.size(), "send row counts") != rows.size(0))
    throw InvalidArgument(fmt::format("exchange_rows: send row counts {} do not sum to the {} rows given",
                                      send_rows, rows.size(0)));
  const int64_t in_total = checked_total(recv_rows, comm.size(), "receive row counts");
  auto counts = std::make_shared<std::vector<int64_t>>();
  for (int64_t c : send_rows) counts->push_back(kernels::checked_mul(c, width, "exchanged elements"));
  for (int64_t c : recv_rows) counts->push_back(kernels::checked_mul(c, width, "exchanged elements"));
  // From the mesh's cache: a fresh block of this size every call would page-fault it again.
  Tensor out = comms.allocator() ? Tensor::empty({in_total, width}, rows.dtype(), rows.device(), comms.allocator())
                                 : Tensor::empty({in_total, width}, rows.dtype(), rows.device());
  const size_t m = send_rows.size();
  collectives::WorkPtr work = comm.all_to_all_v(rows.view({rows.numel()}), std::span(*counts).first(m),
                                                out.view({out.numel()}), std::span(*counts).subspan(m));
  return RowExchangeHandle(&comm, std::move(work), out, std::move(counts));
}

RowExchange exchange_rows(const MeshComms& comms, int mesh_dim, const Tensor& rows,
                          std::span<const int64_t> send_rows, std::string_view label) {
  collectives::Communicator& comm = comms.dim(mesh_dim);
  const collectives::TraceLabel trace_label(comm, [&] { return std::string(label) + " counts"; });
  checked_total(send_rows, comm.size(), "send row counts");
  // The counts travel on the rows' device (a backend such as nccl moves device memory only).
  Tensor send = Tensor::from_vector(std::vector<double>(send_rows.begin(), send_rows.end()),
                                    {static_cast<int64_t>(send_rows.size())}, kernels::DType::kI64);
  if (!rows.device().is_cpu()) send = send.to(rows.device());
  Tensor recv = Tensor::empty({static_cast<int64_t>(send_rows.size())}, kernels::DType::kI64, rows.device());
  comm.wait(comm.all_to_all(send, recv));
  RowExchange ex;
  for (double c : recv.to_vector()) ex.recv_rows.push_back(static_cast<int64_t>(c));
  ex.rows = exchange_rows_known(comms, mesh_dim, rows, send_rows, ex.recv_rows, label).wait();
  return ex;
}

}  // namespace dtensor
