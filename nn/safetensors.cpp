#include "nn/safetensors.h"

#include <fmt/format.h>

#include <bit>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "kernels/error.h"

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
    default:
      return nullptr;
  }
}

DType parse_dtype_name(const std::string& s) {
  for (DType d : {DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kI64, DType::kI32, DType::kU8})
    if (s == dtype_name(d)) return d;
  throw InvalidArgument(
      fmt::format("safetensors: dtype '{}' is not supported (F64, F32, F16, BF16, I64, I32, U8)", s));
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
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw kernels::Error(fmt::format("safetensors: cannot open '{}' for writing", path));
  const uint64_t n = text.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const Tensor& c : data)
    if (c.nbytes() > 0)
      out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
  out.close();
  if (!out) throw kernels::Error(fmt::format("safetensors: writing '{}' failed", path));
}

NamedTensors load_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument(fmt::format("safetensors: cannot open '{}'", path));
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  if (!in || n > (uint64_t{1} << 30))
    throw InvalidArgument(fmt::format("safetensors: '{}' has no valid header length", path));
  std::string text(n, '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  if (!in) throw InvalidArgument(fmt::format("safetensors: '{}' is shorter than its header", path));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("safetensors: '{}' has a malformed header: {}", path, e.what()));
  }
  std::vector<char> rest((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::pair<uint64_t, std::pair<std::string, Tensor>>> out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (metadata)
        for (auto m = it->begin(); m != it->end(); ++m) (*metadata)[m.key()] = m->get<std::string>();
      continue;
    }
    const DType dt = parse_dtype_name((*it)["dtype"].get<std::string>());
    kernels::Dims shape;
    for (const auto& s : (*it)["shape"]) shape.push_back(s.get<int64_t>());
    const uint64_t b = (*it)["data_offsets"][0].get<uint64_t>(), e = (*it)["data_offsets"][1].get<uint64_t>();
    if (e < b || e > rest.size() || e - b != static_cast<uint64_t>(shape.product()) * kernels::itemsize(dt))
      throw InvalidArgument(
          fmt::format("safetensors: tensor '{}' in '{}' has data offsets [{}, {}] that do not fit "
                      "its shape or the file ({} data bytes)",
                      it.key(), path, b, e, rest.size()));
    Tensor t = Tensor::empty(shape, dt);
    if (e > b) std::memcpy(t.data_ptr(), rest.data() + b, e - b);
    out.push_back({b, {it.key(), std::move(t)}});
  }
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  NamedTensors result;
  for (auto& [o, nt] : out) result.push_back(std::move(nt));
  return result;
}

}  // namespace nn
