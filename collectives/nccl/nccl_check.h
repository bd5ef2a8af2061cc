// NCCL and CUDA return codes become kernels::CommError here and nowhere else.
//
// Private to collectives/nccl/*.cpp. Headers never include cuda_runtime.h or nccl.h (the layering
// rule, tests/lint/layering_test.py), so the including .cpp includes them first:
//   #include <cuda_runtime.h>
//   #include <nccl.h>
//   #include "collectives/nccl/nccl_check.h"
//   nccl_check(ncclAllReduce(...), "ncclAllReduce", [&] { return describe_call(); });
//   // throws CommError "ncclAllReduce failed (all_reduce #3 on group 'world' ...): ncclInvalid
//   // Argument (4): invalid argument (run with NCCL_DEBUG=WARN for details); NCCL's last ..."
// The context is a string or a callable returning one, built only on failure.
#pragma once

#if !defined(__CUDA_RUNTIME_H__) || !defined(NCCL_H_)
#error "include <cuda_runtime.h> and <nccl.h> before collectives/nccl/nccl_check.h"
#endif

#include <fmt/format.h>

#include <string>
#include <string_view>
#include <type_traits>

#include "kernels/error.h"

namespace collectives::detail {

inline std::string_view nccl_result_name(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "ncclResult";
  }
}

// "ncclRemoteError (6): remote process exited or there was a network error"
inline std::string nccl_result_text(ncclResult_t r) {
  const char* text = ncclGetErrorString(r);
  return fmt::format("{} ({}): {}", nccl_result_name(r), static_cast<int>(r),
                     text != nullptr ? text : "no description");
}

// "cudaErrorNoDevice (100): no CUDA-capable device is detected"
inline std::string cuda_error_text(cudaError_t e) {
  const char* name = cudaGetErrorName(e);
  const char* text = cudaGetErrorString(e);
  return fmt::format("{} ({}): {}", name != nullptr ? name : "cudaError", static_cast<int>(e),
                     text != nullptr ? text : "no description");
}

template <class Context>
std::string context_text(const Context& context) {
  if constexpr (std::is_invocable_v<const Context&>) {
    return std::string(context());
  } else {
    return std::string(std::string_view(context));
  }
}

// "; NCCL's last error message: ..." when NCCL has one (process-wide, so possibly from another
// communicator), else "".
inline std::string nccl_last_error_suffix() {
  const char* last = ncclGetLastError(nullptr);
  if (last == nullptr || *last == '\0') return {};
  return fmt::format("; NCCL's last error message: {}", last);
}

// The CommError for result `r` of `call`.
template <class Context>
kernels::CommError nccl_error(ncclResult_t r, std::string_view call, const Context& context) {
  return kernels::CommError(fmt::format("{} failed ({}): {}{}", call, context_text(context),
                                        nccl_result_text(r), nccl_last_error_suffix()));
}

// The text of an error reported by ncclCommGetAsyncError (no call to name).
inline std::string nccl_async_error_text(ncclResult_t r) {
  return nccl_result_text(r) + nccl_last_error_suffix();
}

// Whether ncclInProgress is a success: on a non-blocking communicator it means "being enqueued;
// poll ncclCommGetAsyncError until it is ncclSuccess before the next call".
enum class InProgress { kError, kAccept };

// Returns r when it is ncclSuccess (or ncclInProgress, when accepted); throws CommError otherwise.
template <class Context>
ncclResult_t nccl_check(ncclResult_t r, std::string_view call, const Context& context,
                        InProgress in_progress = InProgress::kError) {
  if (r == ncclSuccess || (r == ncclInProgress && in_progress == InProgress::kAccept)) return r;
  throw nccl_error(r, call, context);
}

// Throws CommError unless e is cudaSuccess; clears the runtime's last (non-sticky) error first so
// that later calls start clean.
template <class Context>
void cuda_check(cudaError_t e, std::string_view call, const Context& context) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  throw kernels::CommError(
      fmt::format("{} failed ({}): {}", call, context_text(context), cuda_error_text(e)));
}

}  // namespace collectives::detail
