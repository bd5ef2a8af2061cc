// A fresh directory under the system temp directory, removed with everything in it on
// destruction. Names are unique per process and object: <prefix>-<tag>-<pid>-<n>.
//   testing_support::TempDir tmp("ckpt-test", "reshard");
//   checkpoint::save(tmp.str("a"), sd, world);   // <tmp>/a
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <system_error>

namespace testing_support {

struct TempDir {
  std::filesystem::path path;
  TempDir(const std::string& prefix, const std::string& tag) {
    static std::atomic<int> counter{0};
    path = std::filesystem::temp_directory_path() / fmt::format("{}-{}-{}-{}", prefix, tag, ::getpid(), counter++);
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  // The directory itself (sub empty) or a path inside it.
  std::string str(const std::string& sub = "") const { return (sub.empty() ? path : path / sub).string(); }
};

}  // namespace testing_support
