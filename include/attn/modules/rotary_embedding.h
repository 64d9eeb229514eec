#pragma once

#include <attn/options.h>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <iosfwd>
#include <memory>
#include <utility>

namespace attn {

/// Rotary position embeddings (RoPE): feature pair `i` of the token at
/// position `p` is turned by the angle `p · base^(-2i/dim)`, so that the
/// dot product of a rotated query and a rotated key depends on their
/// positions only through their difference.
///
/// The cos/sin tables are computed in float64, rounded once to the input's
/// dtype, cached per device and dtype and grown on demand (doubling) up to
/// position 2^16, so a decoding loop does not recompute them; positions
/// beyond are computed for each call. The module has no parameters.
///
/// Example:
/// ```
/// attn::RotaryEmbedding rope(64);
/// auto q_rotated = rope(q, /*offset=*/cache_length); // q: (B, H, T, 64)
/// ```
class RotaryEmbeddingImpl : public torch::nn::Cloneable<RotaryEmbeddingImpl> {
 public:
  /// Rotates `dim` features with every other option at its default.
  explicit RotaryEmbeddingImpl(int64_t dim) : RotaryEmbeddingImpl(RotaryEmbeddingOptions(dim)) {}
  /// Checks the options (dim positive and even, base positive and finite).
  explicit RotaryEmbeddingImpl(const RotaryEmbeddingOptions& options);

  /// `x (..., T, F)` with `F >= dim`, floating point: token `t` stands at
  /// position `offset + t`, with `0 <= offset` and `offset + T <= 2^53`.
  /// Returns the rotated tensor, shaped like `x`; differentiable with
  /// respect to `x`.
  torch::Tensor forward(const torch::Tensor& x, int64_t offset = 0);

  /// As `forward`, with each token at its own position: `positions` is
  /// `(T)` (every row alike) or `(B, T)` (row by row, for `x (B, ..., T,
  /// F)`), integers in `[0, 2^53)` on `x`'s device. Packed documents pass
  /// each token's index within its own document, so that positions restart
  /// at every document, as packed training with per-document position ids
  /// does.
  torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& positions);

  /// Checks the options and empties the table cache.
  void reset() override;

  /// Prints `attn::RotaryEmbedding(dim=64, base=10000, interleaved=false)`.
  void pretty_print(std::ostream& stream) const override;

  /// The options the module was constructed with.
  RotaryEmbeddingOptions options;

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(static_cast<int64_t>(0))})

 private:
  struct Tables;
  // The (cos, sin) tables of x's dtype and device (`target`), holding at
  // least positions [0, length), from the cache or computed into it.
  std::pair<torch::Tensor, torch::Tensor> cached_angles(
      int64_t length,
      const torch::TensorOptions& target);
  // Shared by copies of the holder, replaced by reset() (and so by clone()).
  std::shared_ptr<Tables> tables_;
};

/// Holder of `RotaryEmbeddingImpl`, as `TORCH_MODULE` defines it.
TORCH_MODULE(RotaryEmbedding);

} // namespace attn
