#pragma once

// Where the tiled loops' operand policies (tiled_template.h) read a
// request's keys and values: every read names one (b, kv head), keys or
// values, and a run of keys, never a tensor.
// - rows(): a block of keys as one matrix, for the products that read it
//   per block (P V, dQ = dS K, float16's widening). A source that stores
//   keys otherwise (quantized, dequantized on load) writes the block into
//   the task's Buffer and returns it from there.
// - for_each_run(): a head's keys in the runs its source stores
//   contiguously, for what a policy makes once per call (Kᵀ, pairs).
// DenseKeyValues reads the request's (B, Hkv, S, ·) tensors: one run per
// head, every block read where it is. A paged or a quantized cache is one
// more class with these members, made from the call's AttentionParams; a
// policy takes its source as a type parameter, KeyValueSource by default.
// (tests/kernels/test_key_value_source.cpp runs the loops on keys stored
// in scattered pages.)

#include "kernels/attention_params.h"
#include "kernels/cpu/heads.h"
#include "kernels/cpu/tile_product.h"

#include <cstdint>

namespace attn::detail {

enum class KeyOrValue { key, value };

template <typename ElementType>
class DenseKeyValues {
 public:
  using Element = ElementType;
  // What a task lends a read: nothing, the rows are read where they are.
  // (A source that writes a read's rows into it keeps them until the
  // task's next read.)
  struct Buffer {};

  explicit DenseKeyValues(const AttentionParams& params)
      : keys_(params.k), values_(params.v), batch_(params.k.size(0)), heads_(params.k.size(1)) {}

  int64_t batch() const { return batch_; }
  int64_t kv_heads() const { return heads_; }
  int64_t length() const { return keys_.rows; }
  // Features per key (D) or value (Dv).
  int64_t width(KeyOrValue which) const { return of(which).cols; }
  // Whether each key's features lie one after the other.
  bool features_contiguous(KeyOrValue which) const {
    return of(which).cols <= 1 || of(which).column_stride == 1;
  }

  // Keys [first, first + count) of (b, kv_head): row 0 is key `first`.
  MatrixRef<Element> rows(
      KeyOrValue which,
      int64_t b,
      int64_t kv_head,
      int64_t first,
      int64_t count,
      Buffer& /*buffer*/) const {
    return of(which).head(b, kv_head).row_block(first, count);
  }

  // visit(first, run) for each run of (b, kv_head)'s keys, in order: the
  // dense head is one run.
  template <typename Visit>
  void for_each_run(KeyOrValue which, int64_t b, int64_t kv_head, const Visit& visit) const {
    visit(int64_t{0}, of(which).head(b, kv_head));
  }

 private:
  const Heads<Element>& of(KeyOrValue which) const {
    return which == KeyOrValue::key ? keys_ : values_;
  }

  Heads<Element> keys_, values_;
  int64_t batch_, heads_;
};

// The source the operand policies read by default.
template <typename Element>
using KeyValueSource = DenseKeyValues<Element>;

} // namespace attn::detail
