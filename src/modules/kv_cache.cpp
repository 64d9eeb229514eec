#include <attn/kv_cache.h>

#include "sdpa/sequence_starts.h"

#include <torch/torch.h>

#include <algorithm>
#include <utility>

namespace attn {
namespace {

constexpr const char* kKVCacheCaller = "KVCache";
constexpr int64_t kFirstCapacity = 64;

// Storage (B, H, capacity, F) for tokens of `sizes` (B, H, ·, F), the
// first `length` of each sequence copied from `old` when it is defined.
torch::Tensor allocate(
    torch::IntArrayRef sizes,
    const torch::TensorOptions& options,
    int64_t capacity,
    const torch::Tensor& old,
    int64_t length) {
  auto storage = torch::empty({sizes[0], sizes[1], capacity, sizes[3]}, options);
  if (old.defined() && length > 0) {
    storage.narrow(2, 0, length).copy_(old.narrow(2, 0, length));
  }
  return storage;
}

// Whether `storage` (B, H, capacity, F) holds tokens of `sizes` (B, H, ·,
// F) and `options`: same batch, heads, width, dtype and device.
bool same_layout(
    const torch::Tensor& storage,
    torch::IntArrayRef sizes,
    const torch::TensorOptions& options) {
  return storage.size(0) == sizes[0] && storage.size(1) == sizes[1] &&
      storage.size(3) == sizes[3] && storage.scalar_type() == options.dtype().toScalarType() &&
      storage.device() == options.device();
}

void check_keys_and_values(const torch::Tensor& keys, const torch::Tensor& values) {
  TORCH_CHECK(
      keys.defined() && values.defined(), kKVCacheCaller,
      ": keys and values must be defined tensors");
  TORCH_CHECK(
      keys.scalar_type() == values.scalar_type() && keys.device() == values.device(),
      kKVCacheCaller, ": keys and values must share dtype and device, got keys ",
      keys.scalar_type(), " on ", keys.device(), " and values ", values.scalar_type(), " on ",
      values.device());
  TORCH_CHECK(
      !(torch::GradMode::is_enabled() && (keys.requires_grad() || values.requires_grad())),
      kKVCacheCaller, ": the cache holds inference state and cannot carry gradients; ",
      "decode under torch::NoGradGuard (or detach the keys and values)");
}

} // namespace

KVCache::KVCache(int64_t max_length) : max_length_(max_length) {
  TORCH_CHECK(max_length > 0, kKVCacheCaller, ": max_length must be positive, got ", max_length);
}

KVCache::KVCache(KVCache&& other) noexcept
    : keys_(std::move(other.keys_)),
      values_(std::move(other.values_)),
      lengths_(std::exchange(other.lengths_, {})),
      length_(std::exchange(other.length_, 0)),
      max_length_(other.max_length_) {}

KVCache& KVCache::operator=(KVCache&& other) noexcept {
  keys_ = std::move(other.keys_);
  values_ = std::move(other.values_);
  lengths_ = std::exchange(other.lengths_, {});
  length_ = std::exchange(other.length_, 0);
  max_length_ = other.max_length_;
  return *this;
}

bool KVCache::ragged() const {
  return std::adjacent_find(lengths_.begin(), lengths_.end(), std::not_equal_to<>()) !=
      lengths_.end();
}

void KVCache::reserve(
    torch::IntArrayRef key_sizes,
    torch::IntArrayRef value_sizes,
    const torch::TensorOptions& options,
    int64_t needed) {
  if (length_ > 0 || !lengths_.empty()) {
    const auto cached_keys = keys_.sizes(), cached_values = values_.sizes();
    TORCH_CHECK(
        key_sizes[0] == cached_keys[0] && key_sizes[1] == cached_keys[1] &&
            key_sizes[3] == cached_keys[3] && value_sizes[3] == cached_values[3],
        kKVCacheCaller, ": keys must be (B, H, T, D) = (", cached_keys[0], ", ", cached_keys[1],
        ", T, ", cached_keys[3], ") and values (B, H, T, Dv) with Dv = ", cached_values[3],
        " as the cached ones (reset() to start another batch), got keys ", key_sizes,
        " and values ", value_sizes);
    TORCH_CHECK(
        options.dtype() == keys_.dtype() && options.device() == keys_.device(), kKVCacheCaller,
        ": keys and values must have the cached dtype ", keys_.scalar_type(), " and device ",
        keys_.device(), ", got ", options.dtype().toScalarType(), " on ", options.device());
  }
  const int64_t cached = length();

  // Storage that does not fit the new tokens (or no longer matches their
  // shape and dtype after a reset, or was made under InferenceMode, which
  // forbids writing it outside) is replaced.
  const bool writable = !keys_.defined() || !keys_.is_inference() ||
      c10::InferenceMode::is_enabled();
  const bool fits = keys_.defined() && writable && needed <= keys_.size(2) &&
      same_layout(keys_, key_sizes, options) && same_layout(values_, value_sizes, options);
  if (fits) {
    return;
  }
  int64_t capacity = max_length_;
  if (capacity == 0) {
    capacity = keys_.defined() ? std::max<int64_t>(keys_.size(2), 1) : kFirstCapacity;
    while (capacity < needed) {
      capacity *= 2;
    }
  }
  const bool keep = cached > 0;
  keys_ = allocate(key_sizes, options, capacity, keep ? keys_ : torch::Tensor(), cached);
  values_ = allocate(value_sizes, options, capacity, keep ? values_ : torch::Tensor(), cached);
}

std::pair<torch::Tensor, torch::Tensor> KVCache::append(
    const torch::Tensor& keys,
    const torch::Tensor& values) {
  check_keys_and_values(keys, values);
  TORCH_CHECK(
      keys.dim() == 4 && values.dim() == 4 && keys.size(0) == values.size(0) &&
          keys.size(1) == values.size(1) && keys.size(2) == values.size(2),
      kKVCacheCaller, ": keys must be (B, H, T, D) and values (B, H, T, Dv), got keys ",
      keys.sizes(), " and values ", values.sizes());
  const int64_t T = keys.size(2);
  TORCH_CHECK(
      max_length_ == 0 || length() + T <= max_length_, kKVCacheCaller, ": appending ", T,
      " tokens to the ", length(), " cached would exceed max_length ", max_length_,
      " (reset() to start another sequence)");
  reserve(keys.sizes(), values.sizes(), keys.options(), length() + T);
  if (lengths_.empty()) {
    lengths_.assign(keys.size(0), 0);
  }
  if (lengths_.empty()) {
    // B = 0: nothing to hold.
  } else if (!ragged()) {
    keys_.narrow(2, lengths_.front(), T).copy_(keys);
    values_.narrow(2, lengths_.front(), T).copy_(values);
  } else {
    for (size_t b = 0; b < lengths_.size(); ++b) {
      const auto row = static_cast<int64_t>(b);
      keys_[row].narrow(1, lengths_[b], T).copy_(keys[row]);
      values_[row].narrow(1, lengths_[b], T).copy_(values[row]);
    }
  }
  for (auto& length : lengths_) {
    length += T;
  }
  length_ += T;
  zero_past_each_sequence();
  return {this->keys(), this->values()};
}

PackedKeysValues KVCache::append_packed(
    const torch::Tensor& keys,
    const torch::Tensor& values,
    const torch::Tensor& cu_seqlens) {
  check_keys_and_values(keys, values);
  TORCH_CHECK(
      keys.dim() == 3 && values.dim() == 3 && keys.size(0) == values.size(0) &&
          keys.size(1) == values.size(1),
      kKVCacheCaller, ": packed keys must be (total, H, D) and values (total, H, Dv), got keys ",
      keys.sizes(), " and values ", values.sizes());
  const auto starts = detail::sequence_starts(
      kKVCacheCaller, "cu_seqlens", cu_seqlens, keys.size(0));
  const auto N = static_cast<int64_t>(starts.size()) - 1;
  TORCH_CHECK(N > 0, kKVCacheCaller, ": cu_seqlens must hold at least one sequence, got [0]");
  if (!lengths_.empty()) {
    TORCH_CHECK(
        static_cast<int64_t>(lengths_.size()) == N, kKVCacheCaller,
        ": cu_seqlens must count the cache's ", lengths_.size(), " sequences, got ", N);
    TORCH_CHECK(
        keys.size(1) == keys_.size(1) && keys.size(2) == keys_.size(3) &&
            values.size(2) == values_.size(3),
        kKVCacheCaller, ": packed keys must be (total, H, D) = (total, ", keys_.size(1), ", ",
        keys_.size(3), ") and values (total, H, Dv) with Dv = ", values_.size(3),
        " as the cached ones, got keys ", keys.sizes(), " and values ", values.sizes());
  }
  auto lengths = lengths_.empty() ? std::vector<int64_t>(N, 0) : lengths_;
  int64_t needed = 0;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t after = lengths[n] + starts[n + 1] - starts[n];
    TORCH_CHECK(
        max_length_ == 0 || after <= max_length_, kKVCacheCaller, ": appending ",
        starts[n + 1] - starts[n], " tokens to sequence ", n, "'s ", lengths[n],
        " cached would exceed max_length ", max_length_, " (reset() to start another sequence)");
    needed = std::max(needed, after);
  }
  reserve(
      {N, keys.size(1), 0, keys.size(2)}, {N, keys.size(1), 0, values.size(2)}, keys.options(),
      needed);
  lengths_ = std::move(lengths);
  length_ = std::max(length_, needed);

  std::vector<torch::Tensor> all_keys, all_values;
  std::vector<int64_t> cached_starts{0};
  for (int64_t n = 0; n < N; ++n) {
    const int64_t count = starts[n + 1] - starts[n];
    keys_[n].narrow(1, lengths_[n], count).copy_(keys.narrow(0, starts[n], count).transpose(0, 1));
    values_[n]
        .narrow(1, lengths_[n], count)
        .copy_(values.narrow(0, starts[n], count).transpose(0, 1));
    lengths_[n] += count;
    all_keys.push_back(keys_[n].narrow(1, 0, lengths_[n]).transpose(0, 1));
    all_values.push_back(values_[n].narrow(1, 0, lengths_[n]).transpose(0, 1));
    cached_starts.push_back(cached_starts.back() + lengths_[n]);
  }
  zero_past_each_sequence();
  return {torch::cat(all_keys), torch::cat(all_values), torch::tensor(cached_starts, torch::kLong)};
}

void KVCache::zero_past_each_sequence() {
  if (!ragged()) {
    return;
  }
  const int64_t longest = length();
  for (size_t b = 0; b < lengths_.size(); ++b) {
    const auto row = static_cast<int64_t>(b);
    keys_[row].narrow(1, lengths_[b], longest - lengths_[b]).zero_();
    values_[row].narrow(1, lengths_[b], longest - lengths_[b]).zero_();
  }
}

KVCache KVCache::clone() const {
  KVCache copy;
  copy.max_length_ = max_length_;
  copy.lengths_ = lengths_;
  copy.length_ = length_;
  if (keys_.defined()) {
    copy.keys_ = keys_.clone();
    copy.values_ = values_.clone();
  }
  return copy;
}

torch::Tensor KVCache::keys() const {
  return keys_.defined() ? keys_.narrow(2, 0, length()) : torch::Tensor();
}

torch::Tensor KVCache::values() const {
  return values_.defined() ? values_.narrow(2, 0, length()) : torch::Tensor();
}

void KVCache::reset() {
  lengths_.clear();
  length_ = 0;
}

} // namespace attn
