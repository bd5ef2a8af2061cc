// Catch2's implementation (tests/support/catch2_runner.h).
#define CATCH_CONFIG_RUNNER
#include "catch2_runner.h"

#include <catch2/catch.hpp>

namespace test_support {

int run_catch2(int argc, char** argv, const Catch2Run& run) {
  Catch::Session session;
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  if (!run.process_name.empty()) session.configData().processName = run.process_name;  // after: argv[0] sets it
  for (const std::string& spec : run.extra_specs) session.configData().testsOrTags.push_back(spec);
  return session.run();
}

}  // namespace test_support
