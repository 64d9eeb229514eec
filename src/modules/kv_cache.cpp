#include <attn/kv_cache.h>

#include <torch/torch.h>

#include <algorithm>
#include <utility>

namespace attn {
namespace {

constexpr const char* kKVCacheCaller = "KVCache";
constexpr int64_t kFirstCapacity = 64;

// `storage` (B, H, capacity, F) with room for `capacity` tokens, the first
// `length` of them copied from `old` when it is defined.
torch::Tensor allocate(
    const torch::Tensor& like,
    int64_t capacity,
    const torch::Tensor& old,
    int64_t length) {
  auto storage = torch::empty({like.size(0), like.size(1), capacity, like.size(3)}, like.options());
  if (old.defined() && length > 0) {
    storage.narrow(2, 0, length).copy_(old.narrow(2, 0, length));
  }
  return storage;
}

// Whether `storage` (B, H, capacity, F) holds tokens like `t` (B, H, T, F):
// same batch, heads, width, dtype and device.
bool same_layout(const torch::Tensor& storage, const torch::Tensor& t) {
  return storage.size(0) == t.size(0) && storage.size(1) == t.size(1) &&
      storage.size(3) == t.size(3) && storage.scalar_type() == t.scalar_type() &&
      storage.device() == t.device();
}

} // namespace

KVCache::KVCache(int64_t max_length) : max_length_(max_length) {
  TORCH_CHECK(max_length > 0, kKVCacheCaller, ": max_length must be positive, got ", max_length);
}

KVCache::KVCache(KVCache&& other) noexcept
    : keys_(std::move(other.keys_)),
      values_(std::move(other.values_)),
      length_(std::exchange(other.length_, 0)),
      max_length_(other.max_length_) {}

KVCache& KVCache::operator=(KVCache&& other) noexcept {
  keys_ = std::move(other.keys_);
  values_ = std::move(other.values_);
  length_ = std::exchange(other.length_, 0);
  max_length_ = other.max_length_;
  return *this;
}

std::pair<torch::Tensor, torch::Tensor> KVCache::append(
    const torch::Tensor& keys,
    const torch::Tensor& values) {
  TORCH_CHECK(
      keys.defined() && values.defined(), kKVCacheCaller,
      ": keys and values must be defined tensors");
  TORCH_CHECK(
      keys.dim() == 4 && values.dim() == 4 && keys.size(0) == values.size(0) &&
          keys.size(1) == values.size(1) && keys.size(2) == values.size(2),
      kKVCacheCaller, ": keys must be (B, H, T, D) and values (B, H, T, Dv), got keys ",
      keys.sizes(), " and values ", values.sizes());
  TORCH_CHECK(
      keys.scalar_type() == values.scalar_type() && keys.device() == values.device(),
      kKVCacheCaller, ": keys and values must share dtype and device, got keys ",
      keys.scalar_type(), " on ", keys.device(), " and values ", values.scalar_type(), " on ",
      values.device());
  TORCH_CHECK(
      !(torch::GradMode::is_enabled() && (keys.requires_grad() || values.requires_grad())),
      kKVCacheCaller, ": the cache holds inference state and cannot carry gradients; ",
      "decode under torch::NoGradGuard (or detach the keys and values)");

  const int64_t T = keys.size(2);
  if (length_ > 0) {
    const auto cached_keys = keys_.sizes(), cached_values = values_.sizes();
    TORCH_CHECK(
        keys.size(0) == cached_keys[0] && keys.size(1) == cached_keys[1] &&
            keys.size(3) == cached_keys[3] && values.size(3) == cached_values[3],
        kKVCacheCaller, ": keys must be (B, H, T, D) = (", cached_keys[0], ", ", cached_keys[1],
        ", T, ", cached_keys[3], ") and values (B, H, T, Dv) with Dv = ", cached_values[3],
        " as the cached ones (reset() to start another batch), got keys ", keys.sizes(),
        " and values ", values.sizes());
    TORCH_CHECK(
        keys.scalar_type() == keys_.scalar_type() && keys.device() == keys_.device(),
        kKVCacheCaller, ": keys and values must have the cached dtype ", keys_.scalar_type(),
        " and device ", keys_.device(), ", got ", keys.scalar_type(), " on ", keys.device());
  }
  const int64_t needed = length_ + T;
  TORCH_CHECK(
      max_length_ == 0 || needed <= max_length_, kKVCacheCaller, ": appending ", T,
      " tokens to the ", length_, " cached would exceed max_length ", max_length_,
      " (reset() to start another sequence)");

  // Storage that does not fit the new tokens (or no longer matches their
  // shape and dtype after a reset, or was made under InferenceMode, which
  // forbids writing it outside) is replaced.
  const bool writable = !keys_.defined() || !keys_.is_inference() ||
      c10::InferenceMode::is_enabled();
  const bool fits = keys_.defined() && writable && needed <= keys_.size(2) &&
      same_layout(keys_, keys) && same_layout(values_, values);
  if (!fits) {
    int64_t capacity = max_length_;
    if (capacity == 0) {
      capacity = keys_.defined() ? std::max<int64_t>(keys_.size(2), 1) : kFirstCapacity;
      while (capacity < needed) {
        capacity *= 2;
      }
    }
    const bool keep = length_ > 0;
    keys_ = allocate(keys, capacity, keep ? keys_ : torch::Tensor(), length_);
    values_ = allocate(values, capacity, keep ? values_ : torch::Tensor(), length_);
  }
  keys_.narrow(2, length_, T).copy_(keys);
  values_.narrow(2, length_, T).copy_(values);
  length_ = needed;
  return {this->keys(), this->values()};
}

KVCache KVCache::clone() const {
  KVCache copy;
  copy.max_length_ = max_length_;
  copy.length_ = length_;
  if (keys_.defined()) {
    copy.keys_ = keys_.clone();
    copy.values_ = values_.clone();
  }
  return copy;
}

torch::Tensor KVCache::keys() const {
  return keys_.defined() ? keys_.narrow(2, 0, length_) : torch::Tensor();
}

torch::Tensor KVCache::values() const {
  return values_.defined() ? values_.narrow(2, 0, length_) : torch::Tensor();
}

void KVCache::reset() {
  length_ = 0;
}

} // namespace attn
