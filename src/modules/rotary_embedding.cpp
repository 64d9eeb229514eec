#include <attn/modules/rotary_embedding.h>

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <ostream>
#include <vector>

namespace attn {

RotaryEmbeddingOptions::RotaryEmbeddingOptions(int64_t dim) : dim_(dim) {}

namespace {

constexpr const char* kRotaryCaller = "RotaryEmbedding";
constexpr int64_t kFirstTableLength = 256;
// Positions up to here are cached (a table of 2^16 positions holds
// dim · 256 KB in float32); later ones are computed for each call, so that
// a far offset costs its own rows rather than a table reaching it.
constexpr int64_t kLongestTable = int64_t{1} << 16;
// Positions are exact integers in float64 up to 2^53.
constexpr int64_t kLastPosition = int64_t{1} << 53;

// cos and sin of positions' angles, (positions, dim / 2) each.
struct Angles {
  torch::Tensor cos, sin;
};

// cos and sin of the angles of positions [begin, begin + length), in
// float64 (position · base^(-2i/dim), exact for integer positions up to
// 2^53 before the one rounding to `target`).
Angles angle_table(
    const RotaryEmbeddingOptions& options,
    int64_t begin,
    int64_t length,
    const torch::TensorOptions& target) {
  const auto dim = options.dim();
  const auto f64 = torch::TensorOptions(torch::kDouble);
  const auto inverse_frequency = torch::pow(
      options.base(), torch::arange(0, dim, 2, f64) / -static_cast<double>(dim));
  const auto angles = torch::outer(torch::arange(begin, begin + length, f64), inverse_frequency);
  return {angles.cos().to(target), angles.sin().to(target)};
}

} // namespace

// The cached angles of positions [0, length), one table per device and dtype.
struct RotaryEmbeddingImpl::Tables {
  struct Table {
    torch::Device device;
    torch::ScalarType dtype;
    torch::Tensor cos, sin; // (length, dim / 2)
  };
  std::mutex mutex;
  std::vector<Table> tables;
};

RotaryEmbeddingImpl::RotaryEmbeddingImpl(const RotaryEmbeddingOptions& options_)
    : options(options_) {
  reset();
}

void RotaryEmbeddingImpl::reset() {
  const auto dim = options.dim();
  TORCH_CHECK(
      dim > 0 && dim % 2 == 0, kRotaryCaller,
      ": dim must be a positive even number of features (they rotate in ", "pairs), got ", dim);
  TORCH_CHECK(
      std::isfinite(options.base()) && options.base() > 0.0, kRotaryCaller,
      ": base must be a positive finite number, got ", options.base());
  tables_ = std::make_shared<Tables>();
}

torch::Tensor RotaryEmbeddingImpl::forward(const torch::Tensor& x, int64_t offset) {
  const auto dim = options.dim();
  TORCH_CHECK(x.defined(), kRotaryCaller, ": x must be a defined tensor");
  TORCH_CHECK(
      x.dim() >= 2 && x.size(-1) >= dim, kRotaryCaller,
      ": x must be (..., T, F) with F >= dim = ", dim, ", got ", x.sizes());
  TORCH_CHECK(
      torch::isFloatingType(x.scalar_type()), kRotaryCaller,
      ": x must have a floating-point dtype, got ", x.scalar_type());
  TORCH_CHECK(offset >= 0, kRotaryCaller, ": offset must be >= 0, got ", offset);
  const auto T = x.size(-2);
  TORCH_CHECK(
      offset <= kLastPosition - T, kRotaryCaller, ": positions must stay within 2^53 (exact in ",
      "float64), got offset ", offset, " for ", T, " tokens");

  torch::Tensor cos, sin; // (T, dim / 2)
  const auto target = torch::TensorOptions(x.scalar_type()).device(x.device());
  const int64_t needed = offset + T;
  if (needed > kLongestTable) {
    const auto rows = angle_table(options, offset, T, target);
    cos = rows.cos;
    sin = rows.sin;
  } else {
    const std::lock_guard<std::mutex> lock(tables_->mutex);
    auto& tables = tables_->tables;
    auto table = std::find_if(tables.begin(), tables.end(), [&](const Tables::Table& t) {
      return t.device == x.device() && t.dtype == x.scalar_type();
    });
    if (table == tables.end() || table->cos.size(0) < needed) {
      int64_t length = kFirstTableLength;
      while (length < needed) {
        length *= 2;
      }
      auto angles = angle_table(options, 0, length, target);
      Tables::Table fresh{x.device(), x.scalar_type(), angles.cos, angles.sin};
      if (table == tables.end()) {
        tables.push_back(std::move(fresh));
        table = tables.end() - 1;
      } else {
        *table = std::move(fresh);
      }
    }
    cos = table->cos.narrow(0, offset, T);
    sin = table->sin.narrow(0, offset, T);
  }

  const auto rotated = x.narrow(-1, 0, dim);
  torch::Tensor first, second; // the two members of every pair, (..., T, dim/2)
  if (options.interleaved()) {
    const auto pairs = rotated.unflatten(-1, {dim / 2, 2});
    first = pairs.select(-1, 0);
    second = pairs.select(-1, 1);
  } else {
    first = rotated.narrow(-1, 0, dim / 2);
    second = rotated.narrow(-1, dim / 2, dim / 2);
  }
  const auto new_first = first * cos - second * sin;
  const auto new_second = second * cos + first * sin;
  auto result = options.interleaved() ? torch::stack({new_first, new_second}, -1).flatten(-2)
                                      : torch::cat({new_first, new_second}, -1);
  if (dim == x.size(-1)) {
    return result;
  }
  return torch::cat({result, x.narrow(-1, dim, x.size(-1) - dim)}, -1);
}

void RotaryEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "attn::RotaryEmbedding(dim=" << options.dim()
         << ", base=" << options.base() << ", interleaved=" << options.interleaved() << ")";
}

} // namespace attn
