// Compares every rank's layout with the vectors PyTorch itself produced
// (tests/conformance/layout_vectors.json, made by gen_layout_vectors.py).
#include <catch2/catch.hpp>

#include <fstream>
#include <nlohmann/json.hpp>

#include "dtensor/layout.h"
#include "dtensor/spec.h"

using namespace dtensor;

TEST_CASE("layouts match PyTorch's conformance vectors", "[dtensor][layout][conformance]") {
  std::ifstream in(DT_LAYOUT_VECTORS);
  REQUIRE(in.good());
  nlohmann::json data = nlohmann::json::parse(in);
  const auto& cases = data.at("cases");
  INFO("torch " << data.at("torch_version").get<std::string>());
  REQUIRE(cases.size() >= 300);
  int64_t ranks_checked = 0, torch_errors = 0, strided_cases = 0, uneven_cases = 0;
  for (const auto& c : cases) {
    Dims mesh_shape(c.at("mesh").get<std::vector<int64_t>>());
    Dims shape(c.at("shape").get<std::vector<int64_t>>());
    std::string text = c.at("placements").get<std::string>();
    INFO("mesh " << c.at("mesh").dump() << " shape " << c.at("shape").dump() << " placements " << text);
    if (c.contains("error")) {
      ++torch_errors;
      continue;
    }
    Placements ps = normalize_placements(parse_placements(text), mesh_shape.size(), shape.size());
    strided_cases += text.find("_S") != std::string::npos;
    const auto& ranks = c.at("ranks");
    REQUIRE(static_cast<int64_t>(ranks.size()) == mesh_shape.product());
    for (const auto& r : ranks) {
      Dims coord(r.at("coord").get<std::vector<int64_t>>());
      ShardLayout l = compute_layout(shape, mesh_shape, ps, coord);
      INFO("rank " << r.at("rank").get<int>());
      CHECK(l.local_shape.vec() == r.at("local_shape").get<std::vector<int64_t>>());
      CHECK(l.global_offset.vec() == r.at("global_offset").get<std::vector<int64_t>>());
      const auto& indices = r.at("indices");
      REQUIRE(static_cast<int>(indices.size()) == shape.size());
      for (int t = 0; t < shape.size(); ++t)
        CHECK(l.indices(t) == indices[t].get<std::vector<int64_t>>());
      ++ranks_checked;
    }
    for (int t = 0; t < shape.size(); ++t)
      for (int m = 0; m < mesh_shape.size(); ++m)
        if (shard_dim(ps[m]) == t && shape[t] % mesh_shape[m] != 0) {
          ++uneven_cases;
          t = shape.size();
          break;
        }
  }
  INFO(ranks_checked << " ranks, " << strided_cases << " strided cases, " << uneven_cases
                     << " uneven cases, " << torch_errors << " cases where torch raised");
  CHECK(ranks_checked > 1000);
  CHECK(strided_cases >= 50);
  CHECK(uneven_cases >= 50);
}
