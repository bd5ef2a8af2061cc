// Rows exchanged between the members of one mesh dim by all-to-all-v (expert parallelism's token
// dispatch and combine): the row counts first (one all_to_all of one i64 per member), then the
// rows themselves (one all_to_all_v). Both run on the mesh dim's communicator, so they are
// traced and counted (RecordingCommunicator) like every redistribute step.
//
//   // 2 members; this rank sends 3 rows of width 4 to member 0 and 1 row to member 1:
//   RowExchange ex = exchange_rows(comms, /*mesh_dim=*/0, rows /*[4, 4]*/, {3, 1});
//   ex.rows        // [sum of what every member sent here, 4], packed in member order
//   ex.recv_rows   // rows from each member, e.g. {3, 2}
//   // The reverse (combine, or the backward of a dispatch) knows both counts: no count exchange.
//   Tensor back = exchange_rows_known(comms, 0, results, ex.recv_rows, {3, 1}).wait();
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "dtensor/mesh_comms.h"
#include "kernels/tensor.h"

namespace dtensor {

struct RowExchange {
  kernels::Tensor rows;            // [sum(recv_rows), width]
  std::vector<int64_t> recv_rows;  // rows from each member of the mesh dim, in member order
};

// An exchange in flight: wait() returns the received rows.
class RowExchangeHandle {
 public:
  RowExchangeHandle() = default;
  RowExchangeHandle(collectives::Communicator* comm, collectives::WorkPtr work, kernels::Tensor out,
                    std::shared_ptr<std::vector<int64_t>> counts)
      : comm_(comm), work_(std::move(work)), out_(std::move(out)), counts_(std::move(counts)) {}
  kernels::Tensor wait();

 private:
  collectives::Communicator* comm_ = nullptr;
  collectives::WorkPtr work_;
  kernels::Tensor out_;
  std::shared_ptr<std::vector<int64_t>> counts_;  // element counts, alive until the call returns
};

// REQUIRES: rows is a contiguous CPU/device tensor [n, width]; send_rows has one count >= 0 per
// member of mesh dim `mesh_dim` summing to n; recv_rows likewise (what each member sends here).
// Throws InvalidArgument naming the counts otherwise. Collective over the mesh dim.
// `label` names the calls in a trace (Communicator::trace_label), e.g. "moe dispatch".
RowExchangeHandle exchange_rows_known(const MeshComms& comms, int mesh_dim, const kernels::Tensor& rows,
                                      std::span<const int64_t> send_rows, std::span<const int64_t> recv_rows,
                                      std::string_view label = "exchange_rows");
// exchange_rows_known for callers that do not know what they receive: the counts are exchanged
// first (one all_to_all, blocking, labelled "<label> counts"), then the rows (waited for here).
// Same REQUIRES as exchange_rows_known for send_rows.
RowExchange exchange_rows(const MeshComms& comms, int mesh_dim, const kernels::Tensor& rows,
                          std::span<const int64_t> send_rows, std::string_view label = "exchange_rows");

}  // namespace dtensor
