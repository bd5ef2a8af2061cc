// The safetensors file format (Hugging Face's; what Python's `safetensors` package reads):
// 8 bytes little-endian header length N, N bytes of JSON header, then the raw little-endian data.
// The header maps each name to {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}
// (offsets into the data section) plus an optional "__metadata__" object of strings; it is
// padded with spaces to a multiple of 8 bytes so the data section is aligned.
//
//   save_safetensors("init.safetensors", {{"tok_emb.weight", t}}, {{"format", "pt"}});
//   auto tensors = load_safetensors("init.safetensors");   // [("tok_emb.weight", t)]
//
// dtypes: F64, F32, F16, BF16, I64, I32, U8, F8_E4M3, F8_E5M2 (fp8 e4m3fn / e5m2: PyTorch reads
// them as torch.float8_e4m3fn / float8_e5m2; the others raise InvalidArgument).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kernels/tensor.h"

namespace nn {

using NamedTensors = std::vector<std::pair<std::string, kernels::Tensor>>;

// The format's dtype names ("F32", ...): nullptr for a dtype it cannot hold; parse throws
// InvalidArgument naming the string for an unsupported one.
const char* safetensors_dtype_name(kernels::DType dtype);
kernels::DType parse_safetensors_dtype(const std::string& name);

// Writes the tensors (any strides; CPU) in the given order. Throws InvalidArgument for a
// duplicate name or an unsupported dtype, kernels::Error when the file cannot be written.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});
// Reads every tensor (in data order). Throws InvalidArgument for a malformed file.
NamedTensors load_safetensors(const std::string& path,
                              std::map<std::string, std::string>* metadata = nullptr);

}  // namespace nn
