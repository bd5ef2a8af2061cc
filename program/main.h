// Program-level error handling shared by every executable (tests/, bench/, examples/): one call
// in main() maps every exception to the documented exit status and prints ONE line on stderr.
// Programs only: the library layers throw, they never print or exit.
//
//   int main(int argc, char** argv) {
//     return program::run("dtensor-check", [&] {
//       ...                      // throw kernels::InvalidArgument(...) -> exit 2, and so on
//       return program::kOk;
//     });
//   }
//   stderr on a bad --mesh:  "dtensor-check: mesh '3x' is malformed at '': expected ..."
//   stderr on rank 2's OOM:  "dtensor-check: rank 2: out of resources: cannot allocate 4294967296
//                             bytes on cpu: out of memory"
//
// Exit statuses:
//   0 kOk        success
//   1 kMismatch  a wrong result (the program reports it and returns 1), a value that had to be
//                finite and is not (kernels::NonFiniteError: a diverged training), or a result
//                the runtime could not produce for a reason of its own (InternalError, unknown
//                exceptions)
//   2 kInvalid   invalid input or unsupported: kernels::InvalidArgument, kernels::Unsupported,
//                command-line errors (program/cli.h), std::invalid_argument / out_of_range /
//                domain_error
//   3 kResource  out of memory or another resource: kernels::ResourceError (it names the bytes
//                asked for), std::bad_alloc, std::length_error, thread creation failures
//   4 kComm      communication failure: kernels::CommError (timeouts, peers gone; it names the
//                ranks)
#pragma once

#include <cstdio>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include "kernels/error.h"

namespace program {

inline constexpr int kOk = 0, kMismatch = 1, kInvalid = 2, kResource = 3, kComm = 4;

// The longest message printed (longer ones are cut in the middle, kernels::clip).
inline constexpr size_t kMaxMessage = 600;

// Leaves the program with `status` and no further message (help printed, a mismatch already
// reported in full).
struct Exit {
  int status = kOk;
};

// A failure of one rank (a thread of the local backend or a process under mpirun): reported as
// "rank N: <the cause's message>" with the cause's exit status.
class RankError : public std::exception {
 public:
  RankError(int rank, std::exception_ptr cause) : rank_(rank), cause_(std::move(cause)) {}
  int rank() const { return rank_; }
  const std::exception_ptr& cause() const { return cause_; }
  const char* what() const noexcept override { return "rank failure (see cause)"; }

 private:
  int rank_;
  std::exception_ptr cause_;
};

// Runs f() as rank `rank`: what it throws leaves as a RankError naming the rank (a RankError
// passes through unchanged).
template <class F>
decltype(auto) on_rank(int rank, F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const RankError&) {
    throw;
  } catch (...) {
    throw RankError(rank, std::current_exception());
  }
}

struct Failure {
  int status = kMismatch;
  std::string message;  // one line, cut to kMaxMessage; empty for Exit
  int rank = -1;        // the rank that failed, when known
};

// The exit status and message of an exception (see the table above).
inline Failure classify(const std::exception_ptr& e) {
  auto with = [](int status, std::string_view prefix, std::string_view what) {
    std::string msg(prefix);
    msg += what;
    return Failure{status, kernels::clip(msg, kMaxMessage), -1};
  };
  try {
    std::rethrow_exception(e);
  } catch (const Exit& x) {
    return {x.status, "", -1};
  } catch (const RankError& r) {
    Failure f = classify(r.cause());
    if (f.rank < 0 && !f.message.empty()) {
      std::string msg = "rank ";
      msg += std::to_string(r.rank());
      msg += ": ";
      msg += f.message;
      f.message = kernels::clip(msg, kMaxMessage);
      f.rank = r.rank();
    }
    return f;
  } catch (const kernels::InvalidArgument& x) {
    return with(kInvalid, "", x.what());
  } catch (const kernels::Unsupported& x) {
    return with(kInvalid, "", x.what());
  } catch (const kernels::ResourceError& x) {
    return with(kResource, "out of resources: ", x.what());
  } catch (const kernels::CommError& x) {
    return with(kComm, "communication failed: ", x.what());
  } catch (const kernels::NonFiniteError& x) {
    return with(kMismatch, "", x.what());
  } catch (const kernels::InternalError& x) {
    return with(kMismatch, "internal error: ", x.what());
  } catch (const std::bad_alloc& x) {
    return with(kResource, "out of memory: an allocation failed: ", x.what());
  } catch (const std::length_error& x) {
    return with(kResource, "out of memory: a size exceeds what can be allocated: ", x.what());
  } catch (const std::system_error& x) {
    const std::error_code c = x.code();
    if (c == std::errc::resource_unavailable_try_again || c == std::errc::not_enough_memory ||
        c == std::errc::too_many_files_open)
      return with(kResource, "out of resources: ", x.what());
    return with(kMismatch, "internal error: ", x.what());
  } catch (const std::invalid_argument& x) {
    return with(kInvalid, "invalid input: ", x.what());
  } catch (const std::out_of_range& x) {
    return with(kInvalid, "invalid input (out of range): ", x.what());
  } catch (const std::domain_error& x) {
    return with(kInvalid, "invalid input: ", x.what());
  } catch (const std::exception& x) {
    return with(kMismatch, "internal error: ", x.what());
  } catch (...) {
    return {kMismatch, "internal error: an exception that is not a std::exception", -1};
  }
}

// Prints "name: message" on stderr (nothing for an empty message) and returns the status.
inline int report(std::string_view name, const Failure& f) noexcept {
  if (!f.message.empty()) {
    std::fprintf(stderr, "%.*s: %s\n", static_cast<int>(name.size()), name.data(), f.message.c_str());
    std::fflush(stderr);
  }
  return f.status;
}

// One process of a multi-process run (a rank under mpirun): runs f() and, when it throws,
// prints the failure at once, before the caller's shutdown barriers wait for the other ranks,
// then leaves with Exit{status}. Invalid input and unsupported requests are the same on every
// rank, so only rank 0 prints them; any other failure is printed by the rank it happened on,
// naming itself ("rank 2: out of resources: ...").
template <class F>
decltype(auto) run_as_rank(std::string_view name, int rank, F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const Exit&) {
    throw;
  } catch (...) {
    Failure failure = classify(std::current_exception());
    if (failure.status == kInvalid) {
      if (rank == 0) report(name, failure);
      throw Exit{kInvalid};
    }
    throw Exit{report(name, classify(std::make_exception_ptr(RankError(rank, std::current_exception()))))};
  }
}

// Runs body() (returning the exit status) and maps whatever it throws.
template <class Body>
int run(std::string_view name, Body&& body) noexcept {
  try {
    return std::forward<Body>(body)();
  } catch (...) {
    try {
      return report(name, classify(std::current_exception()));
    } catch (...) {  // building the message failed (out of memory): still one line, status 3
      std::fprintf(stderr, "%.*s: out of memory while reporting an error\n", static_cast<int>(name.size()),
                   name.data());
      return kResource;
    }
  }
}

}  // namespace program
