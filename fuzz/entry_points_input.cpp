#include "entry_points_input.h"

#include <attn/functional.h>
#include <attn/kv_cache.h>
#include <attn/modules/multi_head_attention.h>
#include <attn/modules/rotary_embedding.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace attn::fuzz {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
// A leading dim this long only appears where every tensor is empty.
constexpr int64_t kHugeDim = int64_t{1} << 40;

// ---------------------------------------------------------------------------
// Decoding.

// The fuzz input read one byte at a time; past its end, zeros (the first
// choice of every pick), so that every input decodes into some case.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  uint8_t next() { return position_ < size_ ? data_[position_++] : 0; }
  bool flag() { return (next() & 1) != 0; }

  template <typename T>
  T pick(std::initializer_list<T> choices) {
    return choices.begin()[next() % choices.size()];
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t position_ = 0;
};

// How an input tensor is laid out in memory; every layout holds the same
// kind of values.
enum class Layout { contiguous, transposed, expanded, overlapping, stepped };

const char* name_of(Layout layout) {
  constexpr const char* names[] = {
      "contiguous", "transposed", "expanded", "overlapping", "stepped"};
  return names[static_cast<int>(layout)];
}

Layout pick_layout(Bytes& bytes) {
  return bytes.pick(
      {Layout::contiguous, Layout::contiguous, Layout::transposed, Layout::expanded,
       Layout::overlapping, Layout::stepped});
}

// The product of `sizes`, saturating at int64's largest value.
int64_t product(const std::vector<int64_t>& sizes) {
  int64_t result = 1;
  for (const auto size : sizes) {
    if (size == 0) {
      return 0;
    }
    result = result > kInt64Max / size ? kInt64Max : result * size;
  }
  return result;
}

std::vector<int64_t> concat(std::vector<int64_t> first, std::initializer_list<int64_t> rest) {
  first.insert(first.end(), rest);
  return first;
}

std::string shape_text(const std::vector<int64_t>& sizes) {
  return c10::str(torch::IntArrayRef(sizes));
}

std::string optional_text(const c10::optional<int64_t>& value) {
  return value ? std::to_string(*value) : "none";
}

std::string optional_text(const c10::optional<double>& value) {
  return value ? c10::str(*value) : "none";
}

// ---------------------------------------------------------------------------
// Making inputs.

// Normal values times `magnitude`, in `dtype`, laid out as `layout` says.
// Layouts that need two dims or a leading dim fall back to contiguous.
torch::Tensor make_input(
    const std::vector<int64_t>& shape,
    torch::ScalarType dtype,
    double magnitude,
    Layout layout,
    at::Generator& generator) {
  const auto options = torch::TensorOptions(torch::kDouble);
  const auto values = [&](const std::vector<int64_t>& sizes) {
    return (torch::randn(sizes, generator, options) * magnitude).to(dtype);
  };
  const auto rank = static_cast<int64_t>(shape.size());
  if (product(shape) == 0) {
    return torch::empty(shape, torch::TensorOptions(dtype));
  }
  switch (layout) {
    case Layout::transposed:
      if (rank >= 2) {
        auto swapped = shape;
        std::swap(swapped[rank - 1], swapped[rank - 2]);
        return values(swapped).transpose(-1, -2);
      }
      break;
    case Layout::expanded: { // the first dim repeats one slice (stride 0)
      auto one = shape;
      one[0] = 1;
      return values(one).expand(shape);
    }
    case Layout::overlapping: { // rows that share half their elements
      if (rank >= 2) {
        std::vector<int64_t> strides(shape.size());
        strides[rank - 1] = 1;
        strides[rank - 2] = std::max<int64_t>(1, shape[rank - 1] / 2);
        int64_t extent = 1 + (shape[rank - 1] - 1) + (shape[rank - 2] - 1) * strides[rank - 2];
        for (int64_t d = rank - 3; d >= 0; --d) {
          strides[d] = extent;
          extent *= shape[d];
        }
        return values({extent}).as_strided(shape, strides);
      }
      break;
    }
    case Layout::stepped: { // every other element of the last dim
      auto doubled = shape;
      doubled[rank - 1] *= 2;
      return values(doubled).slice(rank - 1, 0, c10::nullopt, 2);
    }
    case Layout::contiguous: break;
  }
  return values(shape);
}

// Whether every element of `t` is finite.
bool all_finite(const torch::Tensor& t) {
  return !t.defined() || t.numel() == 0 || torch::isfinite(t).all().item<bool>();
}

double max_abs(const torch::Tensor& t) {
  return !t.defined() || t.numel() == 0 ? 0.0 : t.abs().max().item<double>();
}

// The largest |a - b|, both in float64, with equal infinities equal.
double max_difference(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.numel() == 0) {
    return 0.0;
  }
  const auto x = a.to(torch::kDouble), y = b.to(torch::kDouble);
  const auto same = x == y; // also +inf == +inf
  return torch::where(same, torch::zeros_like(x), (x - y).abs()).max().item<double>();
}

// Unit roundoff of a dtype's storage.
double epsilon(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kDouble: return std::ldexp(1.0, -53);
    case torch::kBFloat16: return std::ldexp(1.0, -8);
    case torch::kHalf: return std::ldexp(1.0, -11);
    default: return std::ldexp(1.0, -24);
  }
}

// The spacing of a dtype's subnormal numbers: the rounding error of values
// too small for `epsilon`'s relative bound (float16's is 6e-8).
double smallest_step(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kDouble: return std::numeric_limits<double>::denorm_min();
    case torch::kBFloat16: return std::ldexp(1.0, -133);
    case torch::kHalf: return std::ldexp(1.0, -24);
    default: return static_cast<double>(std::numeric_limits<float>::denorm_min());
  }
}

bool is_half_precision(torch::ScalarType dtype) {
  return dtype == torch::kBFloat16 || dtype == torch::kHalf;
}

// With ATTN_FUZZ_VERBOSE set in the environment, prints the call that an
// input decodes into before making it (to reproduce a crash).
void announce(const std::string& description) {
  static const bool verbose = std::getenv("ATTN_FUZZ_VERBOSE") != nullptr;
  if (verbose) {
    std::fprintf(stderr, "%s\n", description.c_str());
  }
}

// Throws OracleViolation saying what went wrong in which case.
class Oracle {
 public:
  explicit Oracle(std::string description) : description_(std::move(description)) {}

  template <typename... Args>
  void expect(bool condition, const Args&... what) const {
    if (!condition) {
      throw OracleViolation(c10::str(what..., "\n  in: ", description_));
    }
  }

  // The float64 reference, which must accept whatever the call accepted.
  template <typename Run>
  auto reference(const Run& run) const -> decltype(run()) {
    try {
      return run();
    } catch (const c10::Error& error) {
      throw OracleViolation(c10::str(
          "the float64 reference refused the call that succeeded: ", error.what_without_backtrace(),
          "\n  in: ", description_));
    }
  }

  void expect_close(
      const char* what,
      const torch::Tensor& actual,
      const torch::Tensor& expected,
      double tolerance) const {
    expect(
        actual.sizes() == expected.sizes(), what, " is ", actual.sizes(), ", expected ",
        expected.sizes());
    const auto difference = max_difference(actual, expected);
    expect(
        difference <= tolerance, what, " differs from the float64 reference by ", difference,
        ", more than the tolerance ", tolerance);
    announce(c10::str(
        "  ", what, " within ", difference, " of the float64 reference (tolerance ", tolerance,
        ")"));
  }

 private:
  std::string description_;
};

// Weights of a softmax: each in [0, 1], each row summing to 1, or to 0
// where every key is masked (within `tolerance` per weight).
void expect_weights_of_a_softmax(
    const Oracle& oracle,
    const torch::Tensor& weights,
    double tolerance) {
  if (weights.numel() == 0) {
    return;
  }
  const auto w = weights.to(torch::kDouble);
  oracle.expect(
      w.min().item<double>() >= -tolerance && w.max().item<double>() <= 1 + tolerance,
      "weights outside [0, 1]: ", w.min().item<double>(), " to ", w.max().item<double>());
  const auto sums = w.sum(-1);
  const auto off = torch::minimum((sums - 1).abs(), sums.abs()).max().item<double>();
  oracle.expect(
      off <= tolerance * static_cast<double>(w.size(-1)) + 1e-6,
      "a row of weights sums to neither 1 nor 0 (off by ", off, ")");
}

// ---------------------------------------------------------------------------
// attn::scaled_dot_product_attention.

enum class MaskKind {
  none,
  bool_pairs,
  bool_keys,
  bool_queries,
  bool_full,
  bool_transposed,
  additive_pairs,
  additive_full,
  other_float_dtype,
  integer,
  wrong_shape
};

const char* name_of(MaskKind kind) {
  constexpr const char* names[] = {
      "none",
      "bool (L, S)",
      "bool (1, S)",
      "bool (L, 1)",
      "bool (..., L, S)",
      "bool (S, L)ᵀ",
      "additive (L, S)",
      "additive (..., L, S)",
      "additive of another dtype",
      "integer (L, S)",
      "bool (L + 1, S)"};
  return names[static_cast<int>(kind)];
}

// The score modifiers a case sets (SDPAOptions), the last three of them
// invalid.
enum class Modifiers {
  none,
  alibi,
  softcap,
  t5_table,
  sinks,
  all,
  clipped_table,
  slopes_of_another_length,
  softcap_zero,
  sinks_with_nan
};

const char* name_of(Modifiers modifiers) {
  static const char* const names[] = {
      "none",      "alibi",         "softcap",       "t5_table",
      "sinks",     "all",           "clipped_table", "slopes of another length",
      "softcap 0", "sinks with NaN"};
  return names[static_cast<int>(modifiers)];
}

// The block mask a case sets (SDPAOptions::block_mask), the last built
// for other sizes than the call's.
enum class BlockMaskKind { none, documents, prefix_lm, per_head_predicate, causal, wrong_size };

const char* name_of(BlockMaskKind kind) {
  static const char* const names[] = {"none",   "documents",      "prefix-LM", "per-head predicate",
                                      "causal", "of another size"};
  return names[static_cast<int>(kind)];
}

struct FunctionCase {
  std::vector<int64_t> leading; // the query's; with enable_gqa the last are its heads
  int64_t kv_heads = 0;         // with enable_gqa (0: as many as the query)
  int64_t L = 0, S = 0, E = 0, Ev = 0;
  torch::ScalarType dtype = torch::kFloat, key_dtype = torch::kFloat;
  double magnitude[3] = {1, 1, 1};
  Layout layout[3] = {};
  MaskKind mask = MaskKind::none;
  double mask_keep = 0.5, mask_value = -kInf;
  SDPAOptions options;
  bool requires_grad = false;
  uint8_t seed = 0;
  Modifiers modifiers = Modifiers::none;
  BlockMaskKind block_mask = BlockMaskKind::none;

  // The query heads, one entry each of the modifiers' tensors.
  int64_t heads() const { return leading.empty() ? 1 : leading.back(); }

  std::vector<int64_t> kv_leading() const {
    auto dims = leading;
    if (kv_heads > 0) {
      dims.back() = kv_heads;
    }
    return dims;
  }

  std::string describe() const {
    std::ostringstream out;
    out << "scaled_dot_product_attention: query " << shape_text(concat(leading, {L, E})) << ", key "
        << shape_text(concat(kv_leading(), {S, E})) << ", value "
        << shape_text(concat(kv_leading(), {S, Ev})) << ", " << dtype << " (key " << key_dtype
        << "), magnitudes " << magnitude[0] << "/" << magnitude[1] << "/" << magnitude[2]
        << ", layouts " << name_of(layout[0]) << "/" << name_of(layout[1]) << "/"
        << name_of(layout[2]) << ", mask " << name_of(mask) << " (keep " << mask_keep << ", value "
        << mask_value << "), is_causal " << options.is_causal() << ", window "
        << optional_text(options.window()) << ", query_offset " << options.query_offset()
        << ", enable_gqa " << options.enable_gqa() << ", scale " << optional_text(options.scale())
        << ", dropout_p " << options.dropout_p() << ", training " << options.training()
        << ", need_weights " << options.need_weights() << ", backend "
        << (options.backend() ? backend_name(*options.backend()) : "chosen") << ", requires_grad "
        << requires_grad << ", seed " << int{seed} << ", modifiers " << name_of(modifiers)
        << ", block mask " << name_of(block_mask);
    return out.str();
  }
};

FunctionCase decode_function_case(Bytes& bytes) {
  FunctionCase c;
  const int rank = bytes.pick({3, 4, 4, 2, 5});
  const bool huge = bytes.next() == 0xff; // a leading dim of 2^40
  for (int d = 0; d < rank - 2; ++d) {
    c.leading.push_back(bytes.pick<int64_t>({1, 2, 3, 4, 1, 2, 5, 0}));
  }
  // Lengths around the fused kernels' query tile (128) and key block (512).
  c.L = bytes.pick<int64_t>(
      {1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, 64, 65, 100, 127, 128, 129, 257, 0});
  c.S = bytes.pick<int64_t>(
      {1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, 64, 65, 100, 129, 511, 512, 513, 1030, 0});
  c.E = bytes.pick<int64_t>({4, 8, 16, 1, 2, 3, 5, 32, 64, 0});
  c.Ev = bytes.pick<int64_t>({4, 8, 16, 1, 3, 33, 0});
  if (huge && !c.leading.empty()) {
    c.leading.front() = kHugeDim;
    c.L = c.S = 0;
  }
  c.options.enable_gqa(bytes.next() % 4 == 0);
  if (c.options.enable_gqa() && !c.leading.empty()) {
    c.kv_heads = bytes.pick<int64_t>({1, 2, 3, 4});
  }
  c.dtype = bytes.pick(
      {torch::kFloat, torch::kFloat, torch::kDouble, torch::kBFloat16, torch::kHalf, torch::kLong});
  c.key_dtype = bytes.next() == 0xfe ? torch::kDouble : c.dtype;
  for (auto& magnitude : c.magnitude) {
    magnitude = bytes.pick({1.0, 0.1, 10.0, 1e3, 1e-3});
  }
  for (auto& layout : c.layout) {
    layout = pick_layout(bytes);
  }
  c.mask = bytes.pick(
      {MaskKind::none, MaskKind::none, MaskKind::bool_pairs, MaskKind::bool_keys,
       MaskKind::bool_queries, MaskKind::bool_full, MaskKind::bool_transposed,
       MaskKind::additive_pairs, MaskKind::additive_full, MaskKind::other_float_dtype,
       MaskKind::integer, MaskKind::wrong_shape});
  c.mask_keep = bytes.pick({0.5, 0.9, 0.1, 0.0, 1.0});
  c.mask_value = bytes.pick({-kInf, -1e4, 0.0, 3.0, -kInf, kInf});
  c.options.is_causal(bytes.flag());
  c.options.window(bytes.pick<c10::optional<int64_t>>(
      {c10::nullopt, c10::nullopt, 1, 2, 3, 7, kInt64Max, 0, -1}));
  c.options.query_offset(bytes.pick<int64_t>(
      {0, 0, 0, 1, -1, 3, -7, 100, int64_t{1} << 60, -(int64_t{1} << 60), (int64_t{1} << 60) + 1,
       std::numeric_limits<int64_t>::min()}));
  c.options.scale(bytes.pick<c10::optional<double>>(
      {c10::nullopt, c10::nullopt, 1.0, 0.0, -0.5, 0.01, 4.0, kNaN, kInf}));
  c.options.dropout_p(bytes.pick({0.0, 0.0, 0.0, 0.2, 0.5, 1.0, -0.1, 1.5, kNaN}));
  c.options.training(bytes.flag());
  c.options.need_weights(bytes.flag());
  c.options.backend(bytes.pick<c10::optional<AttentionBackend>>(
      {c10::nullopt, c10::nullopt, c10::nullopt, AttentionBackend::fused_cpu,
       AttentionBackend::fused_cpu_weights, AttentionBackend::libtorch, AttentionBackend::math}));
  c.requires_grad = bytes.next() % 4 == 0;
  c.seed = bytes.next();
  // Read last, so that inputs written before the modifiers decode as they
  // did (an input that ends here reads none).
  c.modifiers = bytes.pick(
      {Modifiers::none, Modifiers::none, Modifiers::none, Modifiers::alibi, Modifiers::softcap,
       Modifiers::t5_table, Modifiers::sinks, Modifiers::all, Modifiers::clipped_table,
       Modifiers::slopes_of_another_length, Modifiers::softcap_zero, Modifiers::sinks_with_nan});
  c.block_mask = bytes.pick(
      {BlockMaskKind::none, BlockMaskKind::none, BlockMaskKind::documents, BlockMaskKind::prefix_lm,
       BlockMaskKind::per_head_predicate, BlockMaskKind::causal, BlockMaskKind::wrong_size});
  if (huge) {
    c.modifiers = Modifiers::none; // tensors of 2^40 heads
    c.block_mask = BlockMaskKind::none;
  }
  return c;
}

// Nondecreasing document ids of n positions, a new document at about one
// position in five.
torch::Tensor drawn_document_ids(int64_t n, at::Generator& generator) {
  return (torch::rand({n}, generator) < 0.2).to(torch::kLong).cumsum(0);
}

// The case's block mask in its options, drawn from `generator`.
void add_block_mask(FunctionCase& c, at::Generator& generator) {
  const int64_t H = std::max<int64_t>(c.heads(), 1);
  attn::MaskPredicate predicate = attn::causal_mask();
  switch (c.block_mask) {
    case BlockMaskKind::none: return;
    case BlockMaskKind::documents:
      predicate = attn::document_mask(
          drawn_document_ids(c.L, generator), drawn_document_ids(c.S, generator));
      break;
    case BlockMaskKind::prefix_lm:
    case BlockMaskKind::wrong_size:
      predicate = attn::prefix_lm_mask(torch::tensor({int64_t{c.seed} % (c.S + 1)}));
      break;
    case BlockMaskKind::per_head_predicate:
      predicate = attn::MaskPredicate(
          [](int64_t, int64_t h, int64_t i, int64_t j) { return (i + 2 * j + h) % 3 != 0; });
      break;
    case BlockMaskKind::causal: break;
  }
  const bool wrong = c.block_mask == BlockMaskKind::wrong_size;
  c.options.block_mask(attn::block_mask(
      predicate, 1, c.block_mask == BlockMaskKind::per_head_predicate ? H : 1, c.L,
      c.S + (wrong ? 1 : 0)));
}

// The case's score modifiers in its options, drawn from `generator`.
void add_modifiers(FunctionCase& c, at::Generator& generator) {
  const int64_t H = c.heads();
  const auto drawn = [&](std::vector<int64_t> sizes) {
    return torch::randn(sizes, generator, torch::kDouble).to(torch::kFloat);
  };
  const auto m = c.modifiers;
  const bool all = m == Modifiers::all;
  if (all || m == Modifiers::alibi) {
    c.options.alibi_slopes(H > 0 ? attn::alibi_slopes(H) : drawn({0}))
        .alibi_symmetric(c.seed % 2 == 0);
  }
  if (all || m == Modifiers::softcap) {
    c.options.softcap(2.0);
  }
  if (all || m == Modifiers::t5_table || m == Modifiers::clipped_table) {
    auto buckets = attn::PositionBuckets().num_buckets(16).max_distance(40);
    if (m == Modifiers::clipped_table) {
      buckets.bucketing(attn::PositionBucketing::clipped).max_distance(5);
    }
    c.options.position_bias(drawn({H, buckets.count()})).position_buckets(buckets);
  }
  if (all || m == Modifiers::sinks) {
    c.options.sinks(drawn({H}));
  }
  switch (m) {
    case Modifiers::slopes_of_another_length: c.options.alibi_slopes(drawn({H + 1})); break;
    case Modifiers::softcap_zero: c.options.softcap(0.0); break;
    case Modifiers::sinks_with_nan: c.options.sinks(torch::full({H}, kNaN)); break;
    default: break;
  }
}

// Whether a case's results are random or modified: only shapes and
// finiteness are checked (the modifiers' values are the oracle tests',
// tests/sdpa/test_score_modifiers.cpp).
bool only_shapes_and_finiteness(const FunctionCase& c) {
  return (c.options.training() && c.options.dropout_p() > 0) || c.modifiers != Modifiers::none;
}

// Whether a case's tensors stay within kMostElements each (a huge leading
// dim only where every tensor is empty).
bool within_bounds(const FunctionCase& c) {
  const auto q = product(concat(c.leading, {c.L, c.E}));
  const auto kv = product(concat(c.kv_leading(), {c.S, std::max(c.E, c.Ev)}));
  const auto scores = product(concat(c.leading, {c.L, std::max(c.S, c.Ev)}));
  return std::max({q, kv, scores}) <= kMostElements;
}

torch::Tensor make_mask(const FunctionCase& c, at::Generator& generator) {
  const auto keep = [&](const std::vector<int64_t>& shape) {
    return torch::rand(shape, generator) < c.mask_keep;
  };
  const auto additive = [&](const std::vector<int64_t>& shape, torch::ScalarType dtype) {
    const auto zero = torch::zeros({}, torch::kDouble);
    const auto value = torch::full({}, c.mask_value, torch::kDouble);
    return torch::where(keep(shape), zero, value).to(dtype);
  };
  const auto full = concat(c.leading, {c.L, c.S});
  switch (c.mask) {
    case MaskKind::none: return {};
    case MaskKind::bool_pairs: return keep({c.L, c.S});
    case MaskKind::bool_keys: return keep({1, c.S});
    case MaskKind::bool_queries: return keep({c.L, 1});
    case MaskKind::bool_full: return keep(full);
    case MaskKind::bool_transposed: return keep({c.S, c.L}).t();
    case MaskKind::additive_pairs: return additive({c.L, c.S}, c.dtype);
    case MaskKind::additive_full: return additive(full, c.dtype);
    case MaskKind::other_float_dtype:
      return additive({c.L, c.S}, c.dtype == torch::kDouble ? torch::kFloat : torch::kDouble);
    case MaskKind::integer: return keep({c.L, c.S}).to(torch::kLong);
    case MaskKind::wrong_shape: return keep({c.L + 1, c.S});
  }
  return {};
}

// The largest finite magnitude a mask adds to a score; +inf or NaN in it
// makes the inputs non-finite.
double finite_mask_magnitude(const torch::Tensor& mask) {
  if (!mask.defined() || mask.scalar_type() == torch::kBool || mask.numel() == 0) {
    return 0.0;
  }
  const auto m = mask.to(torch::kDouble);
  return max_abs(torch::where(torch::isfinite(m), m, torch::zeros_like(m)));
}

bool mask_is_finite_or_forbidding(const torch::Tensor& mask) {
  if (!mask.defined() || mask.scalar_type() == torch::kBool || mask.numel() == 0) {
    return true;
  }
  const auto m = mask.to(torch::kDouble);
  return (torch::isfinite(m) | (m == -kInf)).all().item<bool>();
}

// Error bounds of a call that attn computes in `compute` precision and
// stores in `storage` precision, with scores of magnitude at most
// `score_bound` from dot products of `terms` products each.
struct Tolerance {
  double scores = 0, weights = 0, output = 0;

  Tolerance(
      double compute,
      double storage,
      double score_bound,
      int64_t terms,
      int64_t keys,
      double value_bound) {
    scores = compute * static_cast<double>(terms + 4) * (score_bound + 1);
    // exp(δ) changes each weight by a factor within e^{±2δ}.
    weights = 4 * scores + 4 * storage;
    output = value_bound * (weights + 4 * compute * static_cast<double>(keys + 2)) + 1e-12;
  }

  Tolerance() = default;

  // Where the scores themselves are this uncertain, the weights are not
  // defined to any useful precision: only finiteness and ranges are
  // checked.
  bool meaningful() const { return scores < 0.05; }
};

// A call's inputs in float64 and the error bounds of its results.
struct FunctionBounds {
  torch::Tensor q, k, v; // float64 copies
  double compute = 0;    // attn accumulates half precision in float32 (its
  double storage = 0;    // bfloat16 loops round the weights to bfloat16, which
                         // the weights' storage term holds), LibTorch's kernel
                         // in the inputs' dtype
  double scale = 0;
  Tolerance tolerance;

  FunctionBounds(
      const FunctionCase& c,
      const torch::Tensor& query,
      const torch::Tensor& key,
      const torch::Tensor& value,
      const torch::Tensor& mask,
      AttentionBackend backend) {
    const auto to_double = [](const torch::Tensor& t) { return t.detach().to(torch::kDouble); };
    q = to_double(query);
    k = to_double(key);
    v = to_double(value);
    storage = epsilon(c.dtype);
    compute = is_half_precision(c.dtype) && backend != AttentionBackend::libtorch
        ? epsilon(torch::kFloat)
        : storage;
    scale = c.options.scale().value_or(
        1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(c.E, 1))));
    const double score_bound = std::abs(scale) * static_cast<double>(c.E) * max_abs(q) *
            max_abs(k) +
        finite_mask_magnitude(mask);
    tolerance = Tolerance(compute, storage, score_bound, c.E, c.S, max_abs(v));
    tolerance.weights += smallest_step(c.dtype);
    tolerance.output += smallest_step(c.dtype);
  }
};

// The options of the float64 reference: the math backend, no dropout,
// weights, and a floating mask in float64.
SDPAOptions reference_options(const FunctionCase& c, const torch::Tensor& mask) {
  auto options = c.options;
  options.backend(AttentionBackend::math).dropout_p(0).need_weights(true);
  if (mask.defined() && mask.scalar_type() != torch::kBool) {
    options.attn_mask(mask.to(torch::kDouble));
  }
  return options;
}

void check_function_result(
    const FunctionCase& c,
    const Oracle& oracle,
    const FunctionBounds& bounds,
    const torch::Tensor& mask,
    const torch::Tensor& output,
    const torch::Tensor& weights) {
  const auto& options = c.options;
  const auto output_shape = concat(c.leading, {c.L, c.Ev});
  oracle.expect(
      output.sizes() == torch::IntArrayRef(output_shape), "output is ", output.sizes(),
      ", expected ", shape_text(output_shape));
  oracle.expect(output.scalar_type() == c.dtype, "output is ", output.scalar_type());
  oracle.expect(
      weights.defined() == options.need_weights(), "weights ",
      weights.defined() ? "returned" : "missing", " with need_weights ", options.need_weights());
  const auto weights_shape = concat(c.leading, {c.L, c.S});
  if (weights.defined()) {
    oracle.expect(
        weights.sizes() == torch::IntArrayRef(weights_shape), "weights are ", weights.sizes(),
        ", expected ", shape_text(weights_shape));
  }
  if (!mask_is_finite_or_forbidding(mask)) {
    return; // +inf or NaN in the mask: anything but a crash
  }
  oracle.expect(all_finite(output), "a non-finite output from finite inputs");
  oracle.expect(all_finite(weights), "non-finite weights from finite inputs");
  if (only_shapes_and_finiteness(c)) {
    return;
  }
  const auto [expected_output, expected_weights] = oracle.reference([&] {
    return attn::scaled_dot_product_attention(
        bounds.q, bounds.k, bounds.v, reference_options(c, mask));
  });
  const auto& tolerance = bounds.tolerance;
  if (weights.defined()) {
    expect_weights_of_a_softmax(oracle, weights, tolerance.weights);
  }
  oracle.expect(
      max_abs(output) <= max_abs(bounds.v) * (1 + 1e-3) + tolerance.output,
      "an output larger than every value: ", max_abs(output));
  if (!tolerance.meaningful()) {
    return;
  }
  oracle.expect_close("output", output, expected_output, tolerance.output);
  if (weights.defined()) {
    oracle.expect_close("weights", weights, expected_weights, tolerance.weights);
  }
}

// The largest finite value of a floating dtype.
double largest_finite(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kHalf: return 65504.0;
    case torch::kDouble: return std::numeric_limits<double>::max();
    default: return static_cast<double>(std::numeric_limits<float>::max());
  }
}

// Gradients of sum(output) against the float64 math path's: finite where
// the true gradient fits the dtype, and within bounds that follow the
// backward's formulas (dV = Pᵀ·dO, dS = P ∘ (dO·Vᵀ − rowsum), dQ = s·dS·K,
// dK = s·dSᵀ·Q) from the weights' tolerance.
void check_function_gradients(
    const FunctionCase& c,
    const Oracle& oracle,
    const FunctionBounds& bounds,
    const torch::Tensor& mask,
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& output) {
  if (!output.requires_grad() || output.numel() == 0 || !mask_is_finite_or_forbidding(mask) ||
      only_shapes_and_finiteness(c)) {
    return;
  }
  const auto gradients = torch::autograd::grad({output.sum()}, {q, k, v}, {}, false, false, true);
  std::vector<torch::Tensor> expected;
  oracle.reference([&] {
    std::vector<torch::Tensor> inputs;
    for (const auto& t : {bounds.q, bounds.k, bounds.v}) {
      inputs.push_back(t.clone().requires_grad_(true));
    }
    const auto out = std::get<0>(attn::scaled_dot_product_attention(
        inputs[0], inputs[1], inputs[2], reference_options(c, mask)));
    expected = torch::autograd::grad({out.sum()}, inputs, {}, false, false, true);
    return 0;
  });
  const auto& tolerance = bounds.tolerance;
  const double qmax = max_abs(bounds.q), kmax = max_abs(bounds.k), vmax = max_abs(bounds.v);
  const double group = c.kv_heads > 0 ? static_cast<double>(c.leading.back() / c.kv_heads) : 1;
  const double L = static_cast<double>(c.L), S = static_cast<double>(c.S);
  const double spread = 2 * static_cast<double>(c.Ev) * vmax; // |dP - rowsum| per pair
  const double per_score = 4 * tolerance.weights * spread +
      bounds.compute * static_cast<double>(c.Ev + c.S + 4) * spread;
  const double scale = std::abs(bounds.scale);
  const double tolerances[3] = {
      4 * (scale * kmax * per_score * S + bounds.compute * S * scale * kmax * spread),
      4 * group * (scale * qmax * per_score * L + bounds.compute * L * scale * qmax * spread),
      4 * group * (tolerance.weights * L + bounds.compute * L)};
  const char* names[3] = {"d query", "d key", "d value"};
  for (int i = 0; i < 3; ++i) {
    if (!gradients[i].defined()) {
      continue;
    }
    const double largest = max_abs(expected[i]);
    if (largest < largest_finite(c.dtype) / 4) {
      oracle.expect(all_finite(gradients[i]), "a non-finite ", names[i], " from finite inputs");
    }
    if (tolerance.meaningful() && all_finite(gradients[i])) {
      oracle.expect_close(
          names[i], gradients[i], expected[i],
          tolerances[i] + 2 * bounds.storage * largest + smallest_step(c.dtype) + 1e-12);
    }
  }
}

void run_function(Bytes& bytes) {
  auto c = decode_function_case(bytes);
  if (!within_bounds(c)) {
    return;
  }
  announce(c.describe());
  auto generator = at::detail::createCPUGenerator(c.seed);
  auto q = make_input(
      concat(c.leading, {c.L, c.E}), c.dtype, c.magnitude[0], c.layout[0], generator);
  auto k = make_input(
      concat(c.kv_leading(), {c.S, c.E}), c.key_dtype, c.magnitude[1], c.layout[1], generator);
  auto v = make_input(
      concat(c.kv_leading(), {c.S, c.Ev}), c.dtype, c.magnitude[2], c.layout[2], generator);
  const auto mask = make_mask(c, generator);
  c.options.attn_mask(mask);
  add_modifiers(c, generator);
  add_block_mask(c, generator);
  const bool differentiable = c.requires_grad && torch::isFloatingType(c.dtype) &&
      c.key_dtype == c.dtype;
  if (differentiable) {
    q.requires_grad_(true);
    k.requires_grad_(true);
    v.requires_grad_(true);
  }
  const auto backend = attn::select_backend(q, k, v, c.options);
  const auto [output, weights] = attn::scaled_dot_product_attention(q, k, v, c.options);
  const Oracle oracle(c.describe() + ", ran " + backend_name(backend));
  const FunctionBounds bounds(c, q, k, v, mask, backend);
  check_function_result(c, oracle, bounds, mask, output, weights);
  if (differentiable) {
    check_function_gradients(c, oracle, bounds, mask, q, k, v, output);
  }
}

// ---------------------------------------------------------------------------
// attn::MultiHeadAttention, one call.

struct ModuleCase {
  int64_t E = 8, H = 2, kdim = 8, vdim = 8, B = 2, L = 3, S = 3;
  c10::optional<int64_t> kv_heads, rotary_dim;
  bool bias = true, bias_kv = false, zero_attn = false, batch_first = true, interleaved = false;
  bool self_attention = false, training = false;
  double dropout = 0;
  torch::ScalarType dtype = torch::kFloat, input_dtype = torch::kFloat;
  double magnitude = 1;
  Layout layout = Layout::contiguous;
  int padding_kind = 0, mask_kind = 0; // see make_module_masks
  double mask_keep = 0.5;
  MultiHeadAttentionForwardOptions forward;
  uint8_t seed = 0;
  // 0: the module's forward; 1: attn::multi_head_attention_forward with
  // the module's parameters; 2: the same with a query projection one row
  // short, which the function must refuse.
  int call = 0;
  // Packed input (make_packing): 0 none; document ids (B, L), (L); sequence
  // starts; ids that decrease; ids one too long.
  int packing = 0;

  MultiHeadAttentionOptions options() const {
    auto o = MultiHeadAttentionOptions(E, H)
                 .kdim(kdim)
                 .vdim(vdim)
                 .bias(bias)
                 .add_bias_kv(bias_kv)
                 .add_zero_attn(zero_attn)
                 .batch_first(batch_first)
                 .dropout(dropout);
    o.num_kv_heads(kv_heads);
    if (rotary_dim) {
      o.rotary(RotaryEmbeddingOptions(*rotary_dim).interleaved(interleaved));
    }
    return o;
  }

  std::string describe() const {
    std::ostringstream out;
    out << "MultiHeadAttention(" << E << ", " << H << ", kdim " << kdim << ", vdim " << vdim
        << ", num_kv_heads " << optional_text(kv_heads) << ", rotary " << optional_text(rotary_dim)
        << (interleaved ? " interleaved" : "") << ", bias " << bias << ", add_bias_kv " << bias_kv
        << ", add_zero_attn " << zero_attn << ", batch_first " << batch_first << ", dropout "
        << dropout << ", training " << training << ") in " << dtype << ": B " << B << ", L " << L
        << ", S " << S << ", inputs " << input_dtype << (self_attention ? " (self-attention)" : "")
        << ", magnitude " << magnitude << ", layout " << name_of(layout)
        << ", key_padding_mask kind " << padding_kind << ", attn_mask kind " << mask_kind
        << " (keep " << mask_keep << "), is_causal " << forward.is_causal() << ", window "
        << optional_text(forward.window()) << ", need_weights " << forward.need_weights()
        << ", average_attn_weights " << forward.average_attn_weights() << ", seed " << int{seed}
        << ", call " << call << ", packing " << packing;
    return out.str();
  }
};

ModuleCase decode_module_case(Bytes& bytes) {
  ModuleCase c;
  c.E = bytes.pick<int64_t>({8, 4, 16, 12, 6, 2, 1, 32, 0});
  c.H = bytes.pick<int64_t>({2, 1, 4, 3, 8, 0});
  c.kdim = bytes.flag() ? c.E : bytes.pick<int64_t>({3, 5, 8, 1});
  c.vdim = bytes.flag() ? c.E : bytes.pick<int64_t>({2, 7, 8, 1});
  c.kv_heads = bytes.pick<c10::optional<int64_t>>({c10::nullopt, c10::nullopt, 1, 2, 3, 0});
  c.rotary_dim = bytes.pick<c10::optional<int64_t>>({c10::nullopt, c10::nullopt, 2, 4, 3, 8});
  c.interleaved = bytes.flag();
  c.bias = bytes.next() % 4 != 0;
  c.bias_kv = bytes.next() % 4 == 0;
  c.zero_attn = bytes.next() % 4 == 0;
  c.batch_first = bytes.next() % 4 != 0;
  c.dropout = bytes.pick({0.0, 0.0, 0.0, 0.3, 1.0, kNaN});
  c.training = bytes.flag();
  c.dtype = bytes.pick({torch::kFloat, torch::kFloat, torch::kDouble});
  c.input_dtype = bytes.next() == 0xfe ? torch::kDouble : c.dtype;
  c.B = bytes.pick<int64_t>({2, 1, 3, 0});
  c.L = bytes.pick<int64_t>({3, 1, 5, 8, 17, 0});
  c.S = bytes.pick<int64_t>({3, 1, 4, 8, 33, 520, 0});
  c.self_attention = bytes.flag();
  c.magnitude = bytes.pick({1.0, 0.1, 3.0, 30.0});
  c.layout = pick_layout(bytes);
  c.padding_kind = bytes.next() % 5;
  c.mask_kind = bytes.next() % 7;
  c.mask_keep = bytes.pick({0.5, 0.9, 0.0, 1.0});
  c.forward.is_causal(bytes.flag());
  c.forward.window(
      bytes.pick<c10::optional<int64_t>>({c10::nullopt, c10::nullopt, 1, 2, 5, kInt64Max, 0}));
  c.forward.need_weights(bytes.flag());
  c.forward.average_attn_weights(bytes.flag());
  c.seed = bytes.next();
  if (c.self_attention) {
    c.kdim = c.vdim = c.E;
    c.S = c.L;
  }
  return c;
}

bool within_bounds(const ModuleCase& c) {
  const auto heads = std::max<int64_t>(c.H, 1);
  return product({c.B, heads, c.L, c.S + 2}) <= kMostElements &&
      product({c.B, c.S, std::max({c.E, c.kdim, c.vdim})}) <= kMostElements &&
      product({c.B, c.L, c.E}) <= kMostElements;
}

// The (B, L, ·) input of the module in its layout: (L, B, ·) when not
// batch-first.
torch::Tensor make_module_input(
    const ModuleCase& c,
    int64_t length,
    int64_t features,
    at::Generator& generator) {
  const auto shape = c.batch_first ? std::vector<int64_t>{c.B, length, features}
                                   : std::vector<int64_t>{length, c.B, features};
  return make_input(shape, c.input_dtype, c.magnitude, c.layout, generator);
}

// key_padding_mask: none, bool, additive, (B, S + 1), integer.
// attn_mask: none, bool (L, S), additive (L, S), (B·H, L, S), (B, H, L, S),
// (1, H, L, S), (L, S + 1).
void make_module_masks(ModuleCase& c, at::Generator& generator) {
  const auto keep = [&](const std::vector<int64_t>& shape) {
    return torch::rand(shape, generator) < c.mask_keep;
  };
  const auto additive = [&](const torch::Tensor& allowed) {
    return torch::zeros(allowed.sizes(), torch::TensorOptions(c.dtype))
        .masked_fill(allowed.logical_not(), -kInf);
  };
  switch (c.padding_kind) {
    case 1: c.forward.key_padding_mask(keep({c.B, c.S}).logical_not()); break;
    case 2: c.forward.key_padding_mask(additive(keep({c.B, c.S}))); break;
    case 3: c.forward.key_padding_mask(keep({c.B, c.S + 1})); break;
    case 4: c.forward.key_padding_mask(keep({c.B, c.S}).to(torch::kLong)); break;
    default: break;
  }
  switch (c.mask_kind) {
    case 1: c.forward.attn_mask(keep({c.L, c.S})); break;
    case 2: c.forward.attn_mask(additive(keep({c.L, c.S}))); break;
    case 3: c.forward.attn_mask(keep({c.B * c.H, c.L, c.S})); break;
    case 4: c.forward.attn_mask(additive(keep({c.B, c.H, c.L, c.S}))); break;
    case 5: c.forward.attn_mask(keep({1, c.H, c.L, c.S})); break;
    case 6: c.forward.attn_mask(keep({c.L, c.S + 1})); break;
    default: break;
  }
}

// Nondecreasing ids of `length` tokens in `rows` rows: a new document
// after each token with probability 1/4.
torch::Tensor random_document_ids(int64_t rows, int64_t length, at::Generator& generator) {
  return (torch::rand({rows, length}, generator) < 0.25).to(torch::kLong).cumsum(1);
}

// The packing of c.packing, drawn after the case's bytes (older seeds
// decode as before, unpacked).
void make_packing(ModuleCase& c, at::Generator& generator) {
  switch (c.packing) {
    case 1: c.forward.document_ids(random_document_ids(c.B, c.L, generator)); break;
    case 2: c.forward.document_ids(random_document_ids(1, c.L, generator)[0]); break;
    case 3: {
      const auto ids = random_document_ids(1, c.L, generator)[0];
      const auto last = c.L > 0 ? ids[-1].item<int64_t>() : -1;
      const auto starts = torch::searchsorted(ids, torch::arange(last + 2, torch::kLong));
      c.forward.cu_seqlens(starts);
      break;
    }
    case 4: c.forward.document_ids(random_document_ids(c.B, c.L, generator).flip({1})); break;
    case 5: c.forward.document_ids(random_document_ids(c.B, c.L + 1, generator)); break;
    default: break;
  }
}

// Random parameters: weights of the initialisation's scale (1/sqrt of
// their inputs, so that scores stay near the inputs' magnitude squared),
// and nonzero biases, which the initialisation leaves zero.
void randomise(torch::nn::Module& module, at::Generator& generator) {
  torch::NoGradGuard no_grad;
  for (auto& parameter : module.parameters()) {
    const auto fan_in = parameter.dim() == 2 ? parameter.size(1) : 1;
    const auto normal = torch::randn(parameter.sizes(), generator, torch::kDouble);
    parameter.copy_(normal / std::sqrt(static_cast<double>(std::max<int64_t>(fan_in, 1))));
  }
}

// A float64 copy of the module and of a forward's floating masks.
MultiHeadAttention float64_copy(const MultiHeadAttention& module) {
  auto copy = std::dynamic_pointer_cast<MultiHeadAttentionImpl>(module->clone());
  copy->to(torch::kDouble);
  return MultiHeadAttention(copy);
}

MultiHeadAttentionForwardOptions with_float64_masks(MultiHeadAttentionForwardOptions options) {
  const auto to_double = [](const torch::Tensor& mask) {
    return mask.defined() && torch::isFloatingType(mask.scalar_type()) ? mask.to(torch::kDouble)
                                                                       : mask;
  };
  options.key_padding_mask(to_double(options.key_padding_mask()));
  options.attn_mask(to_double(options.attn_mask()));
  return options;
}

// Bounds of a module call against its float64 copy, from the actual
// projections: each projection's rounding is at most (n + 2)·eps times
// its sum of |x|·|w| (computed here in float64), and propagates into the
// scores and values and through out_proj as Tolerance describes.
Tolerance module_tolerance(
    const ModuleCase& c,
    MultiHeadAttention module,
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value) {
  const double eps = epsilon(c.dtype);
  const auto f64 = [](const torch::Tensor& t) {
    return t.defined() ? t.detach().to(torch::kDouble) : t;
  };
  struct Projection {
    double largest = 0, error = 0;
  };
  const auto project = [&](const torch::nn::Linear& linear, const torch::Tensor& x) {
    const auto w = f64(linear->weight), b = f64(linear->bias), x64 = f64(x);
    const auto y = torch::nn::functional::linear(x64, w, b);
    const auto magnitudes = torch::nn::functional::linear(
        x64.abs(), w.abs(), b.defined() ? b.abs() : b);
    return Projection{max_abs(y), eps * static_cast<double>(w.size(1) + 2) * max_abs(magnitudes)};
  };
  const auto q = project(module->q_proj, query), k = project(module->k_proj, key);
  const auto v = project(module->v_proj, value);
  // Rotation mixes two features of a pair: up to sqrt(2) larger.
  const double turn = c.rotary_dim ? std::sqrt(2.0) : 1.0;
  const double q_max = turn * q.largest;
  const double k_max = std::max(turn * k.largest, max_abs(module->bias_k));
  const double v_max = std::max(v.largest, max_abs(module->bias_v));
  const int64_t D = c.E / c.H;
  const double scale = 1 / std::sqrt(static_cast<double>(D));
  Tolerance t;
  t.scores = scale * static_cast<double>(D) * (q_max * turn * k.error + k_max * turn * q.error) +
      eps * static_cast<double>(D + 4) * (scale * static_cast<double>(D) * q_max * k_max + 1);
  t.weights = 4 * t.scores + 4 * eps;
  const double attended = v_max * (t.weights + 4 * eps * static_cast<double>(c.S + 4)) + v.error;
  // out_proj: each output sums E products; its error is at most the largest
  // row sum of |W_out| times the attended error, plus its own rounding.
  const auto w_out = f64(module->out_proj->weight).abs();
  const double row_sum = w_out.numel() == 0 ? 0.0 : w_out.sum(1).max().item<double>();
  t.output = 4 *
          (row_sum * attended +
           eps * static_cast<double>(c.E + 2) *
               (row_sum * v_max + max_abs(module->out_proj->bias))) +
      1e-12;
  return t;
}

void check_module_result(
    const ModuleCase& c,
    const MultiHeadAttention& module,
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const torch::Tensor& output,
    const torch::Tensor& weights) {
  const Oracle oracle(c.describe());
  oracle.expect(
      output.sizes() == query.sizes(), "output is ", output.sizes(),
      ", expected the query's shape ", query.sizes());
  oracle.expect(
      weights.defined() == c.forward.need_weights(), "weights ",
      weights.defined() ? "returned" : "missing");
  const auto padding = c.forward.key_padding_mask(), mask = c.forward.attn_mask();
  const bool finite_inputs = mask_is_finite_or_forbidding(padding) &&
      mask_is_finite_or_forbidding(mask);
  if (finite_inputs) {
    oracle.expect(all_finite(output), "a non-finite output from finite inputs");
    oracle.expect(all_finite(weights), "non-finite weights from finite inputs");
  }
  if (c.training && c.dropout > 0) {
    return;
  }
  auto reference = float64_copy(module);
  const auto [expected_output, expected_weights] = oracle.reference([&] {
    const auto q = query.to(torch::kDouble);
    const bool same = query.is_same(key) && key.is_same(value);
    return reference->forward(
        q, same ? q : key.to(torch::kDouble), same ? q : value.to(torch::kDouble),
        with_float64_masks(c.forward));
  });
  if (!finite_inputs) {
    return;
  }
  const auto tolerance = module_tolerance(c, module, query, key, value);
  if (weights.defined() && !c.forward.average_attn_weights()) {
    expect_weights_of_a_softmax(oracle, weights, tolerance.weights);
  }
  if (!tolerance.meaningful()) {
    return;
  }
  oracle.expect_close("output", output, expected_output, tolerance.output);
  if (weights.defined()) {
    oracle.expect_close("weights", weights, expected_weights, tolerance.weights);
  }
}

// The case's call (ModuleCase::call) of `module` or of the function with
// its parameters.
std::tuple<torch::Tensor, torch::Tensor> call_module(
    const ModuleCase& c,
    MultiHeadAttention& module,
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value) {
  if (c.call == 0) {
    return module->forward(query, key, value, c.forward);
  }
  auto parameters = module->functional_parameters();
  const auto call = [&] {
    return attn::multi_head_attention_forward(
        query, key, value, module->options, parameters, c.forward, c.training);
  };
  if (c.call == 1) {
    return call();
  }
  parameters.q_weight = parameters.q_weight.narrow(0, 0, parameters.q_weight.size(0) - 1);
  call(); // throws the c10::Error of a refused call
  throw OracleViolation(c.describe() + ": a q_weight one row short was not refused");
}

MultiHeadAttention make_module(const ModuleCase& c, at::Generator& generator) {
  MultiHeadAttention module(c.options());
  module->to(c.dtype);
  randomise(*module, generator);
  module->train(c.training);
  return module;
}

void run_module(Bytes& bytes) {
  auto c = decode_module_case(bytes);
  c.call = bytes.next() % 3;
  c.packing = bytes.next() % 6;
  if (!within_bounds(c)) {
    return;
  }
  announce(c.describe());
  auto generator = at::detail::createCPUGenerator(c.seed);
  auto module = make_module(c, generator);
  const auto query = make_module_input(c, c.L, c.E, generator);
  const auto key = c.self_attention ? query : make_module_input(c, c.S, c.kdim, generator);
  const auto value = c.self_attention ? query : make_module_input(c, c.S, c.vdim, generator);
  make_module_masks(c, generator);
  make_packing(c, generator);
  torch::NoGradGuard no_grad;
  const auto [output, weights] = call_module(c, module, query, key, value);
  check_module_result(c, module, query, key, value, output, weights);
}

// ---------------------------------------------------------------------------
// attn::MultiHeadAttention decoding through an attn::KVCache.

// A self-attention module decodes a sequence in chunks through a cache;
// the outputs must match one causal forward of the whole sequence by the
// module's float64 copy.
void run_cached_decoding(Bytes& bytes) {
  auto c = decode_module_case(bytes);
  c.self_attention = true;
  c.kdim = c.vdim = c.E;
  c.bias_kv = c.zero_attn = bytes.next() == 0xff; // refused with a cache
  c.padding_kind = c.mask_kind = 0;
  c.forward.is_causal(true).need_weights(false);
  const int64_t T = c.L + c.S;
  const auto max_length = bytes.pick<c10::optional<int64_t>>(
      {c10::nullopt, c10::nullopt, T, T - 1, 1, int64_t{1} << 40, int64_t{1} << 62, kInt64Max});
  // A prompt of L tokens, then up to 6 short steps; the last call decodes
  // whatever remains (at most 8 calls, so that an input stays quick).
  std::vector<int64_t> steps;
  for (int64_t done = 0; done < T;) {
    int64_t step = T - done;
    if (steps.empty()) {
      step = std::max<int64_t>(std::min(c.L, T), 1);
    } else if (steps.size() < 7) {
      step = std::min<int64_t>(step, bytes.pick({1, 1, 2, 3, 7}));
    }
    steps.push_back(step);
    done += step;
  }
  if (T == 0 || product({c.B, std::max<int64_t>(c.H, 1), T, T}) > kMostElements ||
      product({c.B, T, c.E}) > kMostElements) {
    return;
  }
  std::ostringstream description;
  description << "KV-cache decoding of " << c.describe() << " in steps of " << shape_text(steps)
              << ", max_length " << optional_text(max_length);
  announce(description.str());
  auto generator = at::detail::createCPUGenerator(c.seed);
  auto module = make_module(c, generator);
  const auto sequence = make_module_input(c, T, c.E, generator);
  const int time_dim = c.batch_first ? 1 : 0;
  torch::NoGradGuard no_grad;
  KVCache cache = max_length ? KVCache(*max_length) : KVCache();
  auto options = c.forward;
  options.kv_cache(&cache);
  std::vector<torch::Tensor> outputs;
  int64_t position = 0;
  for (const auto step : steps) {
    const auto tokens = sequence.narrow(time_dim, position, step);
    outputs.push_back(std::get<0>(module->forward(tokens, tokens, tokens, options)));
    position += step;
  }
  const auto output = torch::cat(outputs, time_dim);

  const Oracle oracle(description.str());
  oracle.expect(output.sizes() == sequence.sizes(), "decoded output is ", output.sizes());
  oracle.expect(all_finite(output), "a non-finite decoded output from finite inputs");
  oracle.expect(cache.length() == T, "the cache holds ", cache.length(), " tokens after ", T);
  if (c.training && c.dropout > 0) {
    return;
  }
  const auto whole = oracle.reference([&] {
    const auto x = sequence.to(torch::kDouble);
    return std::get<0>(float64_copy(module)->forward(x, x, x, c.forward));
  });
  c.S = T;
  const auto tolerance = module_tolerance(c, module, sequence, sequence, sequence);
  if (tolerance.meaningful()) {
    oracle.expect_close("decoded output", output, whole, tolerance.output);
  }
}

// ---------------------------------------------------------------------------
// attn::RotaryEmbedding.

void run_rotary(Bytes& bytes) {
  const auto dim = bytes.pick<int64_t>({4, 2, 8, 6, 3, 0, -2});
  const auto base = bytes.pick({10000.0, 1.0, 0.5, 500000.0, 0.0, -1.0, kInf, kNaN});
  const bool interleaved = bytes.flag();
  const auto features = dim + bytes.pick<int64_t>({0, 2, 0, -2});
  const auto T = bytes.pick<int64_t>({3, 1, 8, 17, 0});
  const auto leading = bytes.pick<int64_t>({2, 1, 3, 0});
  const auto dtype = bytes.pick({torch::kFloat, torch::kDouble, torch::kBFloat16, torch::kLong});
  const auto offset = bytes.pick<int64_t>(
      {0, 1, 7, 255, 256, 1000, 65536, -1, int64_t{1} << 62, kInt64Max});
  const auto seed = bytes.next();
  std::ostringstream description;
  description << "RotaryEmbedding(dim " << dim << ", base " << base << ", interleaved "
              << interleaved << ") on x [" << leading << ", " << T << ", " << features << "] "
              << dtype << " at offset " << offset << ", seed " << int{seed};
  announce(description.str());
  const Oracle oracle(description.str());

  RotaryEmbedding rotary(RotaryEmbeddingOptions(dim).base(base).interleaved(interleaved));
  auto generator = at::detail::createCPUGenerator(seed);
  const auto x = make_input(
      {leading, T, std::max<int64_t>(features, 0)}, dtype, 1.0, Layout::contiguous, generator);
  const auto rotated = rotary(x, offset);
  oracle.expect(
      rotated.sizes() == x.sizes() && rotated.scalar_type() == dtype, "the result is ",
      rotated.sizes(), " ", rotated.scalar_type());

  // The formula in float64: pair i turns by position · base^(-2i/dim).
  const auto x64 = x.to(torch::kDouble);
  const auto pairs = torch::arange(dim / 2, torch::kDouble);
  const auto positions = torch::arange(T, torch::kDouble) + static_cast<double>(offset);
  const auto angles = torch::outer(positions, torch::pow(base, pairs * -2.0 / dim));
  const auto part = x64.narrow(-1, 0, dim);
  const auto first = interleaved ? part.unflatten(-1, {dim / 2, 2}).select(-1, 0)
                                 : part.narrow(-1, 0, dim / 2);
  const auto second = interleaved ? part.unflatten(-1, {dim / 2, 2}).select(-1, 1)
                                  : part.narrow(-1, dim / 2, dim / 2);
  const auto new_first = first * angles.cos() - second * angles.sin();
  const auto new_second = second * angles.cos() + first * angles.sin();
  auto expected = interleaved ? torch::stack({new_first, new_second}, -1).flatten(-2)
                              : torch::cat({new_first, new_second}, -1);
  expected = torch::cat({expected, x64.narrow(-1, dim, features - dim)}, -1);
  const double tolerance = 8 * epsilon(dtype) * max_abs(x64) + smallest_step(dtype);
  oracle.expect_close("the rotated x", rotated, expected, tolerance);
}

} // namespace

void run_entry_points_input(const uint8_t* data, size_t size) {
  Bytes bytes(data, size);
  switch (bytes.next() % 8) {
    case 0:
    case 1:
    case 2:
    case 3: run_function(bytes); break;
    case 4:
    case 5: run_module(bytes); break;
    case 6: run_cached_decoding(bytes); break;
    default: run_rotary(bytes); break;
  }
}

} // namespace attn::fuzz
