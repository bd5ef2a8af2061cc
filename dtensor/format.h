// fmt support for the dtensor types: fmt::format("{}", x) for DeviceMesh, Placement(s),
// DTensorSpec, Plan and DTensor, using their to_string.
#pragma once

#include <fmt/format.h>

#include "dtensor/dtensor.h"

template <>
struct fmt::formatter<dtensor::DeviceMesh> : fmt::formatter<std::string> {
  auto format(const dtensor::DeviceMesh& v, format_context& ctx) const {
    return fmt::formatter<std::string>::format(dtensor::to_string(v), ctx);
  }
};
template <>
struct fmt::formatter<dtensor::Placement> : fmt::formatter<std::string> {
  auto format(const dtensor::Placement& v, format_context& ctx) const {
    return fmt::formatter<std::string>::format(dtensor::to_string(v), ctx);
  }
};
template <>
struct fmt::formatter<dtensor::DTensorSpec> : fmt::formatter<std::string> {
  auto format(const dtensor::DTensorSpec& v, format_context& ctx) const {
    return fmt::formatter<std::string>::format(dtensor::to_string(v), ctx);
  }
};
template <>
struct fmt::formatter<dtensor::Plan> : fmt::formatter<std::string> {
  auto format(const dtensor::Plan& v, format_context& ctx) const {
    return fmt::formatter<std::string>::format(dtensor::to_string(v), ctx);
  }
};
template <>
struct fmt::formatter<dtensor::DTensor> : fmt::formatter<std::string> {
  auto format(const dtensor::DTensor& v, format_context& ctx) const {
    return fmt::formatter<std::string>::format(dtensor::to_string(v), ctx);
  }
};
