// POSIX file I/O for the layers that read and write files (nn/safetensors, checkpoint/), with
// the exception classes of the exit contract (kernels/error.h, program/main.h):
//   kernels::File in = kernels::File::open_read("ck/checkpoint.json");  // regular files only
//   std::string text = kernels::read_regular_file("ck/checkpoint.json", 1 << 30);
//   kernels::File out = kernels::File::create("out/model.safetensors");
//   out.write_at(data, n, 0);
//   out.sync();
//   out.close();
// Errors name the path (and, for writes, the bytes and the offset):
//   ResourceError    out of space or quota (ENOSPC, EDQUOT, EFBIG), too many open files, no memory
//                    "writing 1048576 bytes at byte 8 of 'ck/x.safetensors' failed: No space left on device"
//   InvalidArgument  permission, read-only filesystem, a missing or not-a-directory path
//                    component, a symlink loop, a name too long, a directory or FIFO where a
//                    file is expected, a truncated file
//                    "cannot open 'ck/checkpoint.json': it is a FIFO, not a regular file"
//   kernels::Error   anything else (EIO: the device failed)
// Opening never blocks: reads open with O_NONBLOCK and refuse what is not a regular file (a FIFO
// without a writer would block the open or the first read forever); writes open with O_NONBLOCK
// (a FIFO without a reader fails with ENXIO) and then clear it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace kernels {

// Throws the class of errno `err` (see above) with message "<what>: <strerror(err)>".
[[noreturn]] void throw_file_error(int err, const std::string& what);

// "a FIFO", "a directory", "a character device", ... for a stat mode (messages).
const char* file_type_name(mode_t mode);

class File {
 public:
  // REQUIRES: path names a regular file (symlinks followed). Throws InvalidArgument otherwise.
  static File open_read(const std::string& path);
  // Creates or truncates path for writing (mode 0644 before the umask).
  static File create(const std::string& path, mode_t mode = 0644);

  File() = default;
  File(File&& o) noexcept;
  File& operator=(File&& o) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  uint64_t size() const;  // fstat's st_size

  // Reads exactly n bytes at `offset` (pread, EINTR retried). A file that ends first throws
  // InvalidArgument "'<path>' ends before <what> (truncated file)".
  void read_at(void* data, uint64_t n, uint64_t offset, std::string_view what) const;
  // Writes exactly n bytes at `offset` (pwrite, EINTR retried).
  void write_at(const void* data, uint64_t n, uint64_t offset);
  void sync();   // fsync; out of space here too on some filesystems
  void close();  // checked close (delayed write errors surface here)

 private:
  File(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
  uint64_t written_end_ = 0;  // the furthest byte written (named when sync fails)
};

// The whole content of a regular file of at most max_bytes bytes (InvalidArgument naming the
// path and the size when larger).
std::string read_regular_file(const std::string& path, uint64_t max_bytes);

// rename(2) with the errors above, naming both paths.
void rename_file(const std::string& from, const std::string& to);

}  // namespace kernels
