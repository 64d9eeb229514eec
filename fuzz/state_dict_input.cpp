#include "state_dict_input.h"

#include "serialization/torch_save_reader.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/torch.h>

#include <cstring>
#include <vector>

namespace attn::fuzz {
namespace {

std::vector<std::string> split_records(const std::string& text) {
  std::vector<std::string> records;
  const std::string separator = kRecordSeparator;
  size_t start = 0;
  while (true) {
    const auto end = text.find(separator, start);
    records.push_back(text.substr(start, end == std::string::npos ? end : end - start));
    if (end == std::string::npos) {
      return records;
    }
    start = end + separator.size();
  }
}

// The zip archive torch.save would write for these records.
std::string archive_of(const std::vector<std::string>& records, bool byte_order_record) {
  std::string archive;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&archive](const void* bytes, size_t n) {
      archive.append(static_cast<const char*>(bytes), n);
      return n;
    });
    writer.writeRecord("data.pkl", records[0].data(), records[0].size());
    for (size_t i = 1; i < records.size(); ++i) {
      const auto& storage = records[i];
      writer.writeRecord("data/" + std::to_string(i - 1), storage.data(), storage.size());
    }
    if (byte_order_record) {
      writer.writeRecord("byteorder", "little", 6);
    }
    writer.writeEndOfFile();
  }
  return archive;
}

// Reads every element of `tensor` through its sizes and strides, in code
// built with AddressSanitizer: a view that the reader let reach past its
// storage is reported here. Large views are sampled at their corners.
void read_every_element(const torch::Tensor& tensor) {
  if (tensor.numel() == 0) {
    return;
  }
  const auto* base = static_cast<const char*>(tensor.data_ptr());
  const auto element_size = static_cast<int64_t>(tensor.element_size());
  std::vector<char> element(static_cast<size_t>(element_size));
  const auto read_at = [&](int64_t index) {
    std::memcpy(element.data(), base + index * element_size, element.size());
  };
  constexpr int64_t kMostElements = 1 << 16;
  if (tensor.numel() > kMostElements) {
    int64_t last = 0;
    for (int64_t d = 0; d < tensor.dim(); ++d) {
      last += (tensor.size(d) - 1) * tensor.stride(d);
    }
    read_at(0);
    read_at(last);
    return;
  }
  std::vector<int64_t> index(static_cast<size_t>(tensor.dim()), 0);
  for (int64_t n = 0; n < tensor.numel(); ++n) {
    int64_t offset = 0;
    for (int64_t d = 0; d < tensor.dim(); ++d) {
      offset += index[d] * tensor.stride(d);
    }
    read_at(offset);
    for (int64_t d = tensor.dim() - 1; d >= 0 && ++index[d] == tensor.size(d); --d) {
      index[d] = 0;
    }
  }
}

} // namespace

std::string state_dict_file_of(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  if (input.empty() || input.rfind("PK", 0) == 0) {
    return input;
  }
  const bool byte_order_record = (data[0] & 1) != 0;
  return archive_of(split_records(input.substr(1)), byte_order_record);
}

void read_state_dict_input(const uint8_t* data, size_t size) {
  const auto file = state_dict_file_of(data, size);
  const auto tensors = attn::detail::read_saved_tensor_dict(
      file.data(), file.size(), "fuzz input", "fuzz");
  for (const auto& entry : tensors) {
    read_every_element(entry.second);
  }
}

} // namespace attn::fuzz
