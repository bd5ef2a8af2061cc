#include "kernels/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "kernels/error.h"

namespace kernels {

namespace {

// Reads and writes go in pieces of at most 1 GiB (Linux caps one call at about 2 GiB).
constexpr uint64_t kStep = uint64_t{1} << 30;

std::string quoted(const std::string& path) {
  std::string out(1, '\'');
  out += clip(path, 200);
  out += '\'';
  return out;
}

}  // namespace

void throw_file_error(int err, const std::string& what) {
  const std::string msg = what + ": " + std::strerror(err);
  switch (err) {
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
    case EMFILE:
    case ENFILE:
    case ENOMEM:
      throw ResourceError(msg);
    case EACCES:
    case EPERM:
    case EROFS:
    case ENOENT:
    case ENOTDIR:
    case EISDIR:
    case ELOOP:
    case ENAMETOOLONG:
    case EEXIST:
    case ENOTEMPTY:
    case ENXIO:
    case ENODEV:
    case ETXTBSY:
    case EINVAL:
    case EXDEV:
      throw InvalidArgument(msg);
    default:
      throw Error(msg);
  }
}

const char* file_type_name(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

File File::open_read(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw_file_error(errno, "cannot open " + quoted(path));
  File f(path, fd);
  struct stat sb;
  if (::fstat(fd, &sb) != 0) throw_file_error(errno, "cannot stat " + quoted(path));
  if (!S_ISREG(sb.st_mode))
    throw InvalidArgument("cannot open " + quoted(path) + ": it is " + file_type_name(sb.st_mode) +
                          ", not a regular file");
  return f;
}

File File::create(const std::string& path, mode_t mode) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NONBLOCK | O_CLOEXEC, mode);
  if (fd < 0) throw_file_error(errno, "cannot create " + quoted(path));
  File f(path, fd);
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0)
    throw_file_error(errno, "cannot set up " + quoted(path));
  return f;
}

File::File(File&& o) noexcept
    : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)), written_end_(o.written_end_) {}

File& File::operator=(File&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    fd_ = std::exchange(o.fd_, -1);
    written_end_ = o.written_end_;
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

uint64_t File::size() const {
  struct stat sb;
  if (::fstat(fd_, &sb) != 0) throw_file_error(errno, "cannot stat " + quoted(path_));
  return static_cast<uint64_t>(sb.st_size);
}

void File::read_at(void* data, uint64_t n, uint64_t offset, std::string_view what) const {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const size_t step = static_cast<size_t>(std::min(n, kStep));
    const ssize_t r = ::pread(fd_, p, step, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw_file_error(errno, "reading " + std::string(what) + " from " + quoted(path_));
    }
    if (r == 0) throw InvalidArgument(quoted(path_) + " ends before " + std::string(what) + " (truncated file)");
    p += r;
    n -= static_cast<uint64_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

void File::write_at(const void* data, uint64_t n, uint64_t offset) {
  const char* p = static_cast<const char*>(data);
  const uint64_t total = n, start = offset;
  while (n > 0) {
    const size_t step = static_cast<size_t>(std::min(n, kStep));
    const ssize_t w = ::pwrite(fd_, p, step, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw_file_error(errno, "writing " + std::to_string(total) + " bytes at byte " + std::to_string(start) +
                                  " of " + quoted(path_) + " failed");
    }
    if (w == 0)  // no progress and no errno: report it as the full device it almost surely is
      throw_file_error(ENOSPC, "writing " + std::to_string(total) + " bytes at byte " + std::to_string(start) + " of " +
                                   quoted(path_) + " failed");
    p += w;
    n -= static_cast<uint64_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  written_end_ = std::max(written_end_, offset);
}

void File::sync() {
  if (::fsync(fd_) != 0)
    throw_file_error(errno, "fsync of " + quoted(path_) + " (" + std::to_string(written_end_) + " bytes) failed");
}

void File::close() {
  const int fd = std::exchange(fd_, -1);
  if (fd >= 0 && ::close(fd) != 0)
    throw_file_error(errno, "closing " + quoted(path_) + " (" + std::to_string(written_end_) + " bytes) failed");
}

std::string read_regular_file(const std::string& path, uint64_t max_bytes) {
  const File f = File::open_read(path);
  const uint64_t n = f.size();
  if (n > max_bytes)
    throw InvalidArgument(quoted(path) + " is " + std::to_string(n) + " bytes; at most " + std::to_string(max_bytes) +
                          " are read");
  std::string text(static_cast<size_t>(n), '\0');
  f.read_at(text.data(), n, 0, "its end");
  return text;
}

void rename_file(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw_file_error(errno, "renaming " + quoted(from) + " to " + quoted(to) + " failed");
}

}  // namespace kernels
