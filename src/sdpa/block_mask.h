#pragma once

// Block masks (<attn/block_mask.h>) inside the library: the predicates'
// common form, which classifies a block of pairs and tests one pair, and
// what a BlockMask holds: the band taken from its predicate and the
// blocks of the rest, in the kernels' form (MaskBlocks).

#include "kernels/attention_params.h"

#include <attn/block_mask.h>
#include <attn/options.h>

#include <torch/types.h>

#include <cstdint>

namespace attn::detail {

// Queries [i0, i1) and keys [j0, j1) of batch row b and head h.
struct PairBlock {
  int64_t b = 0, h = 0, i0 = 0, i1 = 0, j0 = 0, j1 = 0;
};

// The kind of `block` under `band` alone: empty where no query of it
// reaches any of its keys, full where every query reaches all of them.
uint8_t band_block_kind(const KeyBand& band, const PairBlock& block);

// `t` (named `name`, an argument of `caller`) must hold integers.
void check_integers(const char* caller, const char* name, const torch::Tensor& t);

struct MaskPredicateNode {
  virtual ~MaskPredicateNode() = default;
  // kEmptyBlock or kFullBlock where the predicate decides every pair of
  // `block` at once, else kPartialBlock (its pairs are then tested).
  virtual uint8_t classify(const PairBlock& block) const = 0;
  // Whether query i of head (b, h) may attend keys [j0, j1), at most
  // MaskBlocks::kCols of them: out[j - j0] is 1 or 0.
  virtual void allows_row(int64_t b, int64_t h, int64_t i, int64_t j0, int64_t j1, uint8_t* out)
      const = 0;
  // For each query i in [0, L) of batch row b, keys [out[2i], out[2i + 1])
  // outside which the predicate allows none, both ends nondecreasing in i
  // (a row whose begin reaches its end allows none); false where the
  // predicate bounds no row so (any key may be allowed).
  virtual bool key_bounds(int64_t /*b*/, int64_t /*L*/, int64_t /*S*/, int64_t* /*out*/) const {
    return false;
  }
  // Checks the predicate's tensors against a BlockMask's sizes.
  virtual void check_sizes(int64_t /*batch*/, int64_t /*L*/, int64_t /*S*/) const {}
  virtual bool depends_on_batch() const { return false; }
  virtual bool depends_on_heads() const { return false; }
  // The band the predicate is (KeyBand's causal and window, no offset), or
  // nullptr for any other predicate.
  virtual const KeyBand* band() const { return nullptr; }
  // The predicates that must all hold for this one to (itself, unless it
  // is a conjunction).
  virtual void add_conjuncts(std::vector<const MaskPredicateNode*>& into) const {
    into.push_back(this);
  }
};

struct BlockMaskData {
  int64_t batch = 1, heads = 1, L = 0, S = 0;
  // The band taken from the predicate's conjunction (KeyBand: causal,
  // window; S = key length).
  KeyBand band;
  // The blocks of the rest, empty where the band hides the whole block;
  // kinds (1 or batch, 1 or heads, ceil(L / 128), ceil(S / 64)).
  MaskBlocks blocks;
  // Whether the predicate is its band alone: the kernels then need no
  // blocks, and run exactly as for is_causal and window.
  bool band_only = false;
};

// The block mask of `options` must fit the call's scores: query (..., L, E)
// with its heads at -3 (one head and batch row where it has two dims), key
// (..., S, E); its band agrees with is_causal, window and query_offset
// where both set one. `caller` prefixes the message.
void check_block_mask(
    const char* caller,
    const torch::Tensor& query,
    const torch::Tensor& key,
    const SDPAOptions& options);

} // namespace attn::detail
