#pragma once

// The one description of an attention request that every kernel reads:
// the inputs, the mask, the scale and the band of keys each query sees.
// Filled once where a request enters the kernels (sdpa/functional.cpp;
// sdpa/partial_attention.cpp for a part of its keys) and passed down
// unchanged. Below every other part of attn: it includes nothing of attn's.

#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>

namespace torch::autograd {
struct AutogradContext;
} // namespace torch::autograd

namespace attn::detail {

// Query offsets are bounded by 2^60 (no tensor is that long), so every
// query-key distance is below 2^61 and a window of 2^62 reaches every key:
// with both bounds, positions and distances stay in int64.
constexpr int64_t kMaxQueryOffset = int64_t{1} << 60;
constexpr int64_t kUnboundedWindow = int64_t{1} << 62;

// The keys [begin(i), end(i)) that query i sees under SDPAOptions' rules:
// query i stands at key position i + query_offset; `causal` hides the keys
// after it, a positive `window` the keys at a distance of `window` or more.
// Both bounds are nondecreasing in i, so a tile of queries sees
// [begin(first row), end(last row)). What every kernel skips blocks by.
struct KeyBand {
  bool causal = false;
  int64_t query_offset = 0;
  int64_t window = 0; // 0: none; at most kUnboundedWindow
  int64_t S = 0;

  int64_t begin(int64_t i) const {
    return window > 0 ? std::clamp<int64_t>(i + query_offset - window + 1, 0, S) : 0;
  }

  int64_t end(int64_t i) const {
    if (causal) {
      return std::clamp<int64_t>(i + query_offset + 1, 0, S);
    }
    return window > 0 ? std::clamp<int64_t>(i + query_offset + window, 0, S) : S;
  }
};

// Dropout of the attention weights, as the kernels draw it
// (kernels/cpu/dropout.h): each weight dropped with probability p, every
// kept one scaled by 1 / (1 - p); `seed` keys the request's stream of
// random words. The math path draws with LibTorch's dropout instead.
struct DropoutDraw {
  double p = 0.0; // 0 unless training
  uint64_t seed = 0;

  bool active() const { return p > 0.0; }
};

// A user's score function (SDPAOptions::score_function): the new score of
// query i and key j of head (b, h), and its derivative in the score.
struct UserScoreFunction {
  using Fn = std::function<double(double score, int64_t b, int64_t h, int64_t i, int64_t j)>;
  Fn value, derivative;
};

// Runs `calls` (of a user's function, `what` in messages) and turns what
// they throw into a c10::Error "<what> threw: ..."; a c10::Error passes.
template <typename Calls>
void calling_user_function(const char* what, const Calls& calls) {
  try {
    calls();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& error) {
    TORCH_CHECK(false, what, " threw: ", error.what());
  } catch (...) {
    TORCH_CHECK(false, what, " threw a non-standard exception");
  }
}

// Runs `calls` of a user's score function (calling_user_function).
template <typename Calls>
void calling_score_function(const Calls& calls) {
  calling_user_function("scaled_dot_product_attention: score_function", calls);
}

// What changes the scaled scores besides the mask (the score modifiers of
// SDPAOptions), in the kernels' terms. The score s of query i and key j of
// query head h becomes softcap·tanh(s / softcap) (where softcap > 0), then
// user->value(s, b, h, i, j) (where user is set), then has
// offset_bias[h][j - i + L - 1] and the mask added; sinks[h] joins the
// row's softmax denominator. Tensors in the inputs' dtype, or undefined.
struct ScoreModifiers {
  double softcap = 0.0;
  // (H, L + S - 1): every bias that depends on the head and j - i alone
  // (ALiBi, relative-position tables), one entry per distance, built once
  // per call (sdpa/score_modifiers.h).
  torch::Tensor offset_bias;
  torch::Tensor sinks; // (H)
  std::shared_ptr<const UserScoreFunction> user;

  bool active() const {
    return softcap > 0.0 || offset_bias.defined() || sinks.defined() || user != nullptr;
  }
};

// Which blocks of the scores a mask leaves visible, so that the kernels
// skip what no query of a block sees and test no element where every pair
// of a block may attend. A block is kRows queries (a query tile of the
// tiled loops, whose kQueryTile equals it) by kCols keys, from (0, 0).
// `kinds` (Bm, Hm, Qm, ceil(S / kCols)) of uint8 holds a MaskBlockKind per
// block; Bm is 1 or B, Hm 1 or H, Qm 1 (every query tile alike) or
// ceil(L / kRows): a dimension of 1 holds for every index. The elements of
// a partial block are those of `tiles` (n, kRows, kCols) at
// `tile_of[block]` (int32, kinds' shape, -1 elsewhere) where tiles is
// defined (a BlockMask's), else those of the request's bool mask.
enum MaskBlockKind : uint8_t { kEmptyBlock = 0, kFullBlock = 1, kPartialBlock = 2 };

//
// `key_bounds` (Bm, L, 2) int64, where defined (a BlockMask of packed
// documents or sequences): for each query, keys [begin, end) outside which
// the blocks allow none (every head alike), both ends nondecreasing along
// the queries, so that the tiled loops score each block of
// kProductRowBlock queries against its own rows' keys only, not every key
// of a block that a document boundary crosses.
struct MaskBlocks {
  static constexpr int64_t kRows = 128, kCols = 64;
  torch::Tensor kinds, tile_of, tiles;
  torch::Tensor key_bounds;

  // The rows of blocks of L queries, and the blocks of S keys.
  static int64_t query_blocks(int64_t L) { return (L + kRows - 1) / kRows; }
  static int64_t key_blocks(int64_t S) { return (S + kCols - 1) / kCols; }

  bool defined() const { return kinds.defined(); }
};

// Queries, keys and values as heads (B, H, ·, ·).
struct QkvHeads {
  torch::Tensor q, k, v;
};

// The query, key and value heads (B, H, L, D) of `qkv` (B, L, 3, H, D),
// the heads of one projection for Q, K and V (MultiHeadAttention's
// self-attention computes them with one product): views of it.
QkvHeads heads_of_projection(const torch::Tensor& qkv);

// Whether the kernels compute `dtype` as half precision: bfloat16 or
// float16 elements, everything else (softmax, sums, log-sum-exp) in float.
inline bool is_half_precision(torch::ScalarType dtype) {
  return dtype == torch::kBFloat16 || dtype == torch::kHalf;
}

// An attention request as the kernels read it, its arguments already
// checked: q (B, H, L, D), k (B, Hkv, S, D) and v (B, Hkv, S, Dv) with Hkv
// dividing H (query head h reads key/value head h / (H / Hkv)), any
// strides; `mask` undefined or expanded to (B, H, L, S), bool (true = may
// attend) or of the inputs' dtype (added to the scaled scores).
struct AttentionParams {
  torch::Tensor q, k, v;
  // Defined when q, k and v are heads_of_projection(qkv): the fused kernel
  // then takes qkv as its one input and returns its gradient as one tensor
  // of qkv's layout, which the projection's backward reads with no copy.
  torch::Tensor qkv;
  torch::Tensor mask;
  // Where defined, the blocks of the scores that a BlockMask leaves
  // visible (with tiles of its partial blocks; the mask applies besides),
  // or those of the bool mask (no tiles). The band applies besides either.
  MaskBlocks blocks;
  double scale = 1.0;
  // The band of keys each query sees (KeyBand).
  bool causal = false;
  int64_t query_offset = 0;
  int64_t window = 0; // 0: none; at most kUnboundedWindow
  // Dropout: inactive unless training (DropoutDraw).
  DropoutDraw dropout;
  ScoreModifiers modifiers;

  int64_t B() const { return q.size(0); }
  int64_t H() const { return q.size(1); }
  int64_t L() const { return q.size(2); }
  int64_t D() const { return q.size(3); }
  int64_t Hkv() const { return k.size(1); }
  int64_t S() const { return k.size(2); }
  int64_t Dv() const { return v.size(3); }
  // Query heads per key/value head (1 when there are no heads at all).
  int64_t group() const { return Hkv() > 0 ? H() / Hkv() : 1; }
  KeyBand key_band() const { return {causal, query_offset, window, S()}; }

  // Keeps everything but q, k, v and the modifiers' tensors (which
  // autograd saves as variables) in an autograd context between forward
  // and backward, and reads it back into params whose tensors the caller
  // sets.
  void save_settings_to(torch::autograd::AutogradContext& ctx) const;
  static AttentionParams restore_settings_from(torch::autograd::AutogradContext& ctx);
};

// What every kernel's forward returns and its backward reads: the output
// (B, H, L, Dv), the row log-sum-exp (B, H, L) of the scaled, masked
// scores (-inf for a row that sees no key), and the weights (B, H, L, S)
// where the kernel materialises them (the kernels that return weights;
// undefined in the fused kernels, whose backward recomputes them from lse).
// In half precision the fused kernels' tiled loops may also keep what
// rounding the output into its dtype lost, out_rounding (B, H, L, Dv) =
// the float output - out, rounded into out's dtype, where the caller
// defines it: the backward adds it to out for the softmax backward's
// delta_i = dO_i·O_i, so that the learned tensors' gradients, which sum
// it, carry no rounding of the output. In bfloat16 the forward that
// writes it also multiplies P unrounded into V, without which O itself
// carries P's rounding (sdpa/plan.cpp, keeps_out_rounding).
struct ForwardResult {
  torch::Tensor out, lse;
  torch::Tensor weights = {};
  torch::Tensor out_rounding = {};
};

// The gradients of q, k and v, shaped like them, and of what the score
// modifiers and the mask add to the scores where the caller asks for them
// by defining the tensor (the kernels write every element): offset_bias
// (H, L + S - 1), mask (B, H, L, S), sinks (H).
struct InputGradients {
  torch::Tensor dq, dk, dv;
  torch::Tensor d_offset_bias = {}, d_mask = {}, d_sinks = {};
};

} // namespace attn::detail
