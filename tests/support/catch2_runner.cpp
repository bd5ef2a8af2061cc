// Catch2's implementation (tests/support/catch2_runner.h).
#define CATCH_CONFIG_RUNNER
#include "catch2_runner.h"

#include <catch2/catch.hpp>

namespace test_support {
namespace {
int g_sample_stride = 1;  // set once by run_catch2, before any test runs
}  // namespace

int sample_stride() { return g_sample_stride; }

int run_catch2(int argc, char** argv, const Catch2Run& run) {
  Catch::Session session;
  int stride = 1;
  session.cli(session.cli() | Catch::clara::Opt(stride, "N")["--sample"](
                                  "run about one case in N of the large sweeps (default 1: all)"));
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  if (stride < 1) {
    Catch::cerr() << "--sample " << stride << ": expected a positive integer\n";
    return 2;
  }
  g_sample_stride = stride;
  if (!run.process_name.empty()) session.configData().processName = run.process_name;  // after: argv[0] sets it
  for (const std::string& spec : run.extra_specs) session.configData().testsOrTags.push_back(spec);
  return session.run();
}

}  // namespace test_support
