// Command-line helpers shared by the programs (CLI11): parsing whose errors exit 2 through
// program::run (program/main.h) instead of CLI11's own codes (a range error is 105 there), and
// the --timeout-ms option every program takes.
//
//   CLI::App app{"dtensor-check"};
//   int64_t timeout_ms = program::kDefaultTimeoutMs;
//   program::add_timeout(app, timeout_ms);
//   program::parse(app, argc, argv);   // --help: prints, exits 0; a bad option: exit 2
#pragma once

#include <CLI/CLI.hpp>

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <string>

#include "kernels/error.h"
#include "program/main.h"

namespace program {

// --timeout-ms: how long any one wait (a collective, a shutdown or print barrier) may block
// before the program fails naming the ranks it waited for (exit 4). At most one day, so a
// deadline computed from it never overflows the clock.
inline constexpr int64_t kDefaultTimeoutMs = 300'000;
inline constexpr int64_t kMaxTimeoutMs = 86'400'000;

inline CLI::Option* add_timeout(CLI::App& app, int64_t& timeout_ms, const std::string& what = "") {
  return app
      .add_option("--timeout-ms", timeout_ms,
                  what.empty() ? "how long one wait (a collective, a shutdown or print barrier) may block before "
                                 "the program fails naming the ranks it waited for (exit 4)"
                               : what)
      ->check(CLI::Range(int64_t{1}, kMaxTimeoutMs))
      ->capture_default_str();
}

// A uint64 option's check: CLI11 itself wraps -1 and saturates values past 2^64 - 1.
inline const CLI::Validator kUint64(
    [](std::string& text) -> std::string {
      uint64_t v = 0;
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (text.empty() || ec != std::errc() || end != text.data() + text.size())
        return "value " + kernels::clip(text, 40) + " is not an integer in 0..18446744073709551615";
      return "";
    },
    "UINT64");

// app.parse with the program's conventions: --help prints the (sub)command's help and leaves
// with status 0; any other parse error is an InvalidArgument (status 2) carrying CLI11's
// message, which names the option and the value.
inline void parse(CLI::App& app, int argc, char** argv) {
  // CLI11 says only "A subcommand is required" for a mistyped one: name it.
  std::string known;
  bool found = false;
  for (const CLI::App* sub : app.get_subcommands({})) {
    if (!known.empty()) known += ", ";
    known += sub->get_name();
    found = found || (argc > 1 && sub->get_name() == argv[1]);
  }
  if (!known.empty() && argc > 1 && argv[1][0] != '-' && !found) {
    std::string msg = "unknown subcommand '";
    msg += kernels::clip(argv[1], 40);
    msg += "': expected one of ";
    msg += known;
    throw kernels::InvalidArgument(msg);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    throw Exit{kOk};
  } catch (const CLI::CallForAllHelp&) {
    std::fputs(app.help("", CLI::AppFormatMode::All).c_str(), stdout);
    throw Exit{kOk};
  } catch (const CLI::CallForVersion& e) {
    std::puts(e.what());
    throw Exit{kOk};
  } catch (const CLI::ParseError& e) {
    throw kernels::InvalidArgument(std::string(e.what()) + " (see --help)");
  }
}

}  // namespace program
