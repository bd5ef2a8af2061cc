// Overloaded: a set of lambdas as one visitor for std::visit.
//
//   std::visit(Overloaded{[](const Shard& s) { return s.dim; },
//                         [](const auto&) { return -1; }},
//              placement);
#pragma once

namespace kernels {

template <class... Ts>
struct Overloaded : Ts... {
  using Ts::operator()...;
};
// Needed by clang 14 (no aggregate deduction yet); the sanitizer and fuzz builds use clang.
template <class... Ts>
Overloaded(Ts...) -> Overloaded<Ts...>;

}  // namespace kernels
