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

// cos and sin of the angles of `positions` (float64, any shape), in
// float64 (position · base^(-2i/dim), exact for integer positions up to
// 2^53 before the one rounding to `target`): (positions..., dim / 2).
Angles angles_at(
    const RotaryEmbeddingOptions& options,
    const torch::Tensor& positions,
    const torch::TensorOptions& target) {
  const auto dim = options.dim();
  const auto f64 = torch::TensorOptions(torch::kDouble).device(positions.device());
  const auto inverse_frequency = torch::pow(
      options.base(), torch::arange(0, dim, 2, f64) / -static_cast<double>(dim));
  const auto angles = positions.unsqueeze(-1) * inverse_frequency;
  return {angles.cos().to(target), angles.sin().to(target)};
}

// The angles of positions [begin, begin + length).
Angles angle_table(
    const RotaryEmbeddingOptions& options,
    int64_t begin,
    int64_t length,
    const torch::TensorOptions& target) {
  return angles_at(options, torch::arange(begin, begin + length, torch::kDouble), target);
}

void check_rotated_input(const torch::Tensor& x, int64_t dim) {
  TORCH_CHECK(x.defined(), kRotaryCaller, ": x must be a defined tensor");
  TORCH_CHECK(
      x.dim() >= 2 && x.size(-1) >= dim, kRotaryCaller,
      ": x must be (..., T, F) with F >= dim = ", dim, ", got ", x.sizes());
  TORCH_CHECK(
      torch::isFloatingType(x.scalar_type()), kRotaryCaller,
      ": x must have a floating-point dtype, got ", x.scalar_type());
}

// `positions` must be (T) or (B, T) integers in [0, 2^53) on x's device,
// for x (B, ..., T, F); returns the largest.
int64_t check_positions(const torch::Tensor& x, const torch::Tensor& positions) {
  TORCH_CHECK(positions.defined(), kRotaryCaller, ": positions must be a defined tensor");
  const int64_t T = x.size(-2);
  const bool per_row = positions.dim() == 2 && x.dim() >= 3 &&
      positions.sizes() == torch::IntArrayRef({x.size(0), T});
  TORCH_CHECK(
      (positions.dim() == 1 && positions.size(0) == T) || per_row, kRotaryCaller,
      ": positions must be (T) = (", T, ")", x.dim() >= 3 ? " or (B, T) = (" : "",
      x.dim() >= 3 ? std::to_string(x.size(0)) + ", " + std::to_string(T) + ")" : "", " for x ",
      x.sizes(), ", got ", positions.sizes());
  TORCH_CHECK(
      torch::isIntegralType(positions.scalar_type(), /*includeBool=*/false), kRotaryCaller,
      ": positions must be integers, got ", positions.scalar_type());
  TORCH_CHECK(
      positions.device() == x.device(), kRotaryCaller, ": positions must be on x's device ",
      x.device(), ", got ", positions.device());
  if (positions.numel() == 0) {
    return -1;
  }
  const auto bounds = torch::aminmax(positions.to(torch::kLong));
  const int64_t first = std::get<0>(bounds).item<int64_t>();
  const int64_t last = std::get<1>(bounds).item<int64_t>();
  TORCH_CHECK(
      first >= 0 && last < kLastPosition, kRotaryCaller,
      ": positions must lie in [0, 2^53) (exact in float64), got ", first, " to ", last);
  return last;
}

// x (..., T, F) with its first `dim` features turned by the angles whose
// cos and sin are `cos` and `sin` (broadcast against (..., T, dim / 2)).
torch::Tensor rotate_pairs(
    const torch::Tensor& x,
    const torch::Tensor& cos,
    const torch::Tensor& sin,
    const RotaryEmbeddingOptions& options) {
  const auto dim = options.dim();
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

std::pair<torch::Tensor, torch::Tensor> RotaryEmbeddingImpl::cached_angles(
    int64_t length,
    const torch::TensorOptions& target) {
  const std::lock_guard<std::mutex> lock(tables_->mutex);
  auto& tables = tables_->tables;
  auto table = std::find_if(tables.begin(), tables.end(), [&](const Tables::Table& t) {
    return t.device == target.device() && t.dtype == target.dtype().toScalarType();
  });
  if (table == tables.end() || table->cos.size(0) < length) {
    int64_t rows = kFirstTableLength;
    while (rows < length) {
      rows *= 2;
    }
    auto angles = angle_table(options, 0, rows, target);
    Tables::Table fresh{target.device(), target.dtype().toScalarType(), angles.cos, angles.sin};
    if (table == tables.end()) {
      tables.push_back(std::move(fresh));
      table = tables.end() - 1;
    } else {
      *table = std::move(fresh);
    }
  }
  return {table->cos, table->sin};
}

torch::Tensor RotaryEmbeddingImpl::forward(const torch::Tensor& x, int64_t offset) {
  check_rotated_input(x, options.dim());
  TORCH_CHECK(offset >= 0, kRotaryCaller, ": offset must be >= 0, got ", offset);
  const auto T = x.size(-2);
  TORCH_CHECK(
      offset <= kLastPosition - T, kRotaryCaller, ": positions must stay within 2^53 (exact in ",
      "float64), got offset ", offset, " for ", T, " tokens");

  const auto target = torch::TensorOptions(x.scalar_type()).device(x.device());
  if (offset + T > kLongestTable) {
    const auto rows = angle_table(options, offset, T, target);
    return rotate_pairs(x, rows.cos, rows.sin, options);
  }
  const auto [cos, sin] = cached_angles(offset + T, target);
  return rotate_pairs(x, cos.narrow(0, offset, T), sin.narrow(0, offset, T), options);
}

torch::Tensor RotaryEmbeddingImpl::rotate(const torch::Tensor& x, const torch::Tensor& positions) {
  check_rotated_input(x, options.dim());
  const int64_t last = check_positions(x, positions);
  const auto target = torch::TensorOptions(x.scalar_type()).device(x.device());
  torch::Tensor cos, sin; // (positions..., dim / 2)
  if (last >= kLongestTable) {
    const auto rows = angles_at(options, positions.to(torch::kDouble), target);
    cos = rows.cos;
    sin = rows.sin;
  } else {
    const auto table = cached_angles(last + 1, target);
    const auto flat = positions.reshape({-1}).to(torch::kLong);
    std::vector<int64_t> shape = positions.sizes().vec();
    shape.push_back(options.dim() / 2);
    cos = table.first.index_select(0, flat).view(shape);
    sin = table.second.index_select(0, flat).view(shape);
  }
  if (positions.dim() == 2) {
    // (B, T, dim / 2) against x (B, ..., T, F): ones for the dims between.
    for (int64_t d = 3; d < x.dim(); ++d) {
      cos = cos.unsqueeze(1);
      sin = sin.unsqueeze(1);
    }
  }
  return rotate_pairs(x, cos, sin, options);
}

void RotaryEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "attn::RotaryEmbedding(dim=" << options.dim()
         << ", base=" << options.base() << ", interleaved=" << options.interleaved() << ")";
}

} // namespace attn
