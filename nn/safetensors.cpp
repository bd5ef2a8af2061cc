#include "nn/safetensors.h"

#include <fmt/format.h>

#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "kernels/checked.h"
#include "kernels/error.h"
#include "kernels/file_io.h"
#include "kernels/format.h"

namespace nn {

using kernels::DType;
using kernels::InvalidArgument;
using kernels::Tensor;

namespace {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kF64:
      return "F64";
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kI64:
      return "I64";
    case DType::kI32:
      return "I32";
    case DType::kU8:
      return "U8";
    case DType::kF8E4M3:
      return "F8_E4M3";  // torch.float8_e4m3fn
    case DType::kF8E5M2:
      return "F8_E5M2";  // torch.float8_e5m2
    default:
      return nullptr;
  }
}

DType parse_dtype_name(const std::string& s) {
  for (DType d : {DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kI64, DType::kI32, DType::kU8,
                  DType::kF8E4M3, DType::kF8E5M2})
    if (s == dtype_name(d)) return d;
  throw InvalidArgument(fmt::format(
      "safetensors: dtype '{}' is not supported (F64, F32, F16, BF16, I64, I32, U8, F8_E4M3, F8_E5M2)", s));
}

}  // namespace

const char* safetensors_dtype_name(DType dtype) { return dtype_name(dtype); }
DType parse_safetensors_dtype(const std::string& name) { return parse_dtype_name(name); }

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  std::vector<Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (!names.insert(name).second)
      throw InvalidArgument(fmt::format("safetensors: tensor '{}' appears twice", name));
    if (name == "__metadata__") throw InvalidArgument("safetensors: '__metadata__' is reserved");
    const char* dn = dtype_name(t.dtype());
    if (!dn) throw InvalidArgument(fmt::format("safetensors: tensor '{}' has an unsupported dtype", name));
    Tensor c = t.device().is_cpu() ? t.contiguous() : t.to(kernels::Device{}).contiguous();
    const uint64_t bytes = c.nbytes();
    header[name] = {{"dtype", dn}, {"shape", c.shape().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(std::move(c));
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text += ' ';
  // Errors name the path (and the bytes when the device is full): kernels/file_io.h.
  kernels::File out = kernels::File::create(path);
  const uint64_t n = text.size();
  out.write_at(&n, 8, 0);
  out.write_at(text.data(), n, 8);
  uint64_t pos = 8 + n;
  for (const Tensor& c : data) {
    if (c.nbytes() > 0) out.write_at(c.data_ptr(), c.nbytes(), pos);
    pos += c.nbytes();
  }
  out.close();
}

namespace {

// A header entry's integer list (shape or data_offsets), each in [0, max]; InvalidArgument
// naming the tensor, the file and the field otherwise.
std::vector<int64_t> header_ints(const nlohmann::json& entry, const char* field, const std::string& name,
                                 const std::string& path, int64_t max = kernels::kInt64Max) {
  auto bad = [&] {
    return InvalidArgument(fmt::format("safetensors: tensor '{}' in '{}' has '{}' {} (expected a list of integers in "
                                       "0..{})",
                                       name, path, field,
                                       entry.contains(field) ? kernels::clip(entry[field].dump()) : "missing", max));
  };
  if (!entry.contains(field) || !entry[field].is_array()) throw bad();
  std::vector<int64_t> out;
  for (const auto& v : entry[field]) {
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() > static_cast<uint64_t>(max)) throw bad();
      out.push_back(static_cast<int64_t>(v.get<uint64_t>()));
    } else if (v.is_number_integer()) {
      if (v.get<int64_t>() < 0 || v.get<int64_t>() > max) throw bad();
      out.push_back(v.get<int64_t>());
    } else {
      throw bad();
    }
  }
  return out;
}

}  // namespace

NamedTensors load_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  const kernels::File in = kernels::File::open_read(path);  // regular files only: never blocks
  const uint64_t file_size = in.size();
  uint64_t n = 0;
  if (file_size < 8) throw InvalidArgument(fmt::format("safetensors: '{}' is too short ({} bytes)", path, file_size));
  in.read_at(&n, 8, 0, "the header length");
  if (n > (uint64_t{1} << 30) || n > file_size - 8)
    throw InvalidArgument(fmt::format("safetensors: '{}' has an invalid header length {} (the file has {} bytes)", path,
                                      n, file_size));
  std::string text(n, '\0');
  in.read_at(text.data(), n, 8, "the header");
  const uint64_t data_start = 8 + n, data_bytes = file_size - data_start;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("safetensors: '{}' has a malformed header: {}", path, e.what()));
  }
  if (!header.is_object())
    throw InvalidArgument(fmt::format("safetensors: '{}' has a header that is not a JSON object", path));
  std::vector<std::pair<uint64_t, std::pair<std::string, Tensor>>> out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object())
        throw InvalidArgument(fmt::format("safetensors: '{}' has a __metadata__ that is not an object", path));
      if (metadata)
        for (auto m = it->begin(); m != it->end(); ++m) {
          if (!m->is_string())
            throw InvalidArgument(
                fmt::format("safetensors: '{}' has __metadata__ entry '{}' that is not a string", path, m.key()));
          (*metadata)[m.key()] = m->get<std::string>();
        }
      continue;
    }
    const std::string& name = it.key();
    if (!it->is_object() || !it->contains("dtype") || !(*it)["dtype"].is_string())
      throw InvalidArgument(fmt::format("safetensors: tensor '{}' in '{}' has no dtype string", name, path));
    const DType dt = parse_dtype_name((*it)["dtype"].get<std::string>());
    const std::vector<int64_t> dims = header_ints(*it, "shape", name, path);
    const std::vector<int64_t> offs = header_ints(*it, "data_offsets", name, path);
    if (dims.size() > static_cast<size_t>(kernels::kMaxDims))
      throw InvalidArgument(fmt::format("safetensors: tensor '{}' in '{}' has {} dims (at most {} are supported)", name,
                                        path, dims.size(), kernels::kMaxDims));
    const kernels::Dims shape(dims);
    const std::string what = fmt::format("safetensors: the bytes of tensor '{}' in '{}'", name, path);
    const int64_t bytes = kernels::checked_bytes(kernels::checked_product(dims, what), kernels::itemsize(dt), what);
    if (offs.size() != 2 || offs[1] < offs[0] || static_cast<uint64_t>(offs[1]) > data_bytes ||
        offs[1] - offs[0] != bytes)
      throw InvalidArgument(
          fmt::format("safetensors: tensor '{}' in '{}' has data offsets {} that do not fit its shape {} ({} bytes) "
                      "or the file ({} data bytes)",
                      name, path, kernels::clip((*it)["data_offsets"].dump()), shape, bytes, data_bytes));
    Tensor t = Tensor::empty(shape, dt);
    if (bytes > 0)
      in.read_at(t.data_ptr(), static_cast<uint64_t>(bytes), data_start + static_cast<uint64_t>(offs[0]),
                 fmt::format("the data of '{}'", name));
    out.push_back({static_cast<uint64_t>(offs[0]), {name, std::move(t)}});
  }
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  NamedTensors result;
  for (auto& [o, nt] : out) result.push_back(std::move(nt));
  return result;
}

}  // namespace nn
