#include "sdpa/score_modifiers.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

namespace attn::detail {
namespace {

// The dtype the backends compute a query's scores in: float32 for half
// precision on the CPU (attn's kernels), else the query's.
torch::ScalarType score_dtype(const torch::Tensor& query) {
  const auto dtype = query.scalar_type();
  const bool half = dtype == torch::kHalf || dtype == torch::kBFloat16;
  return half && query.device().is_cpu() ? torch::kFloat : dtype;
}

// A per-head tensor of the modifiers (named `name`) must be floating, on
// the query's device, `expected` in shape, and finite in the dtype the
// scores are computed in.
void check_head_tensor(
    const char* caller,
    const char* name,
    const torch::Tensor& t,
    const torch::Tensor& query,
    at::IntArrayRef expected) {
  TORCH_CHECK(
      t.is_floating_point(), caller, ": ", name, " must have a floating-point dtype, got ",
      t.scalar_type());
  TORCH_CHECK(
      t.device() == query.device(), caller, ": ", name, " must be on the query's device ",
      query.device(), ", got ", t.device());
  TORCH_CHECK(
      t.sizes() == expected, caller, ": ", name, " must be ", expected,
      " (one entry per query head), got ", t.sizes());
  const auto dtype = score_dtype(query);
  TORCH_CHECK(
      torch::isfinite(t.detach().to(dtype)).all().item<bool>(), caller, ": ", name,
      " must be finite in ", dtype, ", the dtype of the scores, got a value that is not");
}

} // namespace

void check_position_buckets(const char* caller, const PositionBuckets& buckets) {
  const int64_t n = buckets.num_buckets(), distance = buckets.max_distance();
  TORCH_CHECK(
      n > 0 && distance > 0, caller, ": position_buckets needs num_buckets > 0 and ",
      "max_distance > 0, got num_buckets ", n, " and max_distance ", distance);
  if (buckets.bucketing() == PositionBucketing::clipped) {
    return;
  }
  // T5 splits the buckets: half by sign (bidirectional), then half of
  // those exact; the logarithmic ones span exact .. max_distance.
  const bool bidirectional = buckets.bucketing() == PositionBucketing::t5_bidirectional;
  const int64_t exact = (bidirectional ? n / 2 : n) / 2;
  TORCH_CHECK(
      exact > 0 && distance > exact, caller, ": T5's ", bidirectional ? "bidirectional" : "causal",
      " buckets need num_buckets >= ", bidirectional ? 4 : 2,
      " and max_distance above the exact buckets (", exact, "), got num_buckets ", n,
      " and max_distance ", distance);
}

namespace {

// ALiBi's term of each head and distance (H, W): slope·d, or -slope·|d|.
torch::Tensor alibi_bias(
    const torch::Tensor& slopes,
    const torch::Tensor& distances,
    bool symmetric) {
  const auto d = distances.to(torch::kDouble);
  return slopes.to(torch::kDouble).unsqueeze(1) * (symmetric ? -d.abs() : d).unsqueeze(0);
}

} // namespace

bool has_score_modifiers(const SDPAOptions& options) {
  return options.alibi_slopes().defined() || options.softcap().has_value() ||
      options.position_bias().defined() || options.sinks().defined() ||
      options.score_function() != nullptr;
}

void check_score_modifiers(
    const char* caller,
    const torch::Tensor& query,
    const SDPAOptions& options) {
  const int64_t H = query.dim() >= 3 ? query.size(-3) : 1;
  if (options.alibi_slopes().defined()) {
    check_head_tensor(caller, "alibi_slopes", options.alibi_slopes(), query, {H});
  }
  if (options.softcap()) {
    // NaN, infinities and values that round to 0 or overflow in that dtype
    // fail alike.
    const double cap = *options.softcap();
    const auto in_dtype = torch::scalar_tensor(cap, torch::kDouble).to(score_dtype(query));
    TORCH_CHECK(
        torch::isfinite(in_dtype).item<bool>() && in_dtype.item<double>() > 0.0, caller,
        ": softcap must be a positive finite number in ", score_dtype(query),
        ", the dtype of the scores, got ", cap);
  }
  if (options.position_bias().defined()) {
    check_position_buckets(caller, options.position_buckets());
    check_head_tensor(
        caller, "position_bias", options.position_bias(), query,
        {H, options.position_buckets().count()});
  }
  if (options.sinks().defined()) {
    check_head_tensor(caller, "sinks", options.sinks(), query, {H});
  }
  if (const auto& function = options.score_function()) {
    TORCH_CHECK(
        function->value && function->derivative, caller,
        ": score_function needs both its value and its derivative, got value ",
        function->value ? "set" : "empty", " and derivative ",
        function->derivative ? "set" : "empty");
  }
}

// T5's `_relative_position_bucket` (Raffel et al. 2020; the reference code
// of mesh-tensorflow and Hugging Face's T5Attention), in float32 as it
// computes the logarithmic buckets; or the distance clipped to
// [-max_distance, max_distance], shifted to start at 0.
torch::Tensor position_buckets(const torch::Tensor& distances, const PositionBuckets& buckets) {
  const int64_t distance = buckets.max_distance();
  if (buckets.bucketing() == PositionBucketing::clipped) {
    return distances.clamp(-distance, distance) + distance;
  }
  int64_t n = buckets.num_buckets();
  auto bucket = torch::zeros_like(distances);
  torch::Tensor magnitude;
  if (buckets.bucketing() == PositionBucketing::t5_bidirectional) {
    n /= 2;
    bucket = bucket + (distances > 0).to(torch::kLong) * n;
    magnitude = distances.abs();
  } else {
    magnitude = -distances.clamp_max(0);
  }
  const int64_t exact = n / 2;
  const auto logarithmic = ((magnitude.to(torch::kFloat) / static_cast<double>(exact)).log() /
                            std::log(static_cast<double>(distance) / static_cast<double>(exact)) *
                            static_cast<double>(n - exact))
                               .to(torch::kLong) +
      exact;
  return bucket + torch::where(magnitude < exact, magnitude, logarithmic.clamp_max(n - 1));
}

ScoreModifiers score_modifiers(
    const SDPAOptions& options,
    int64_t H,
    int64_t L,
    int64_t S,
    torch::ScalarType dtype) {
  ScoreModifiers modifiers;
  modifiers.softcap = options.softcap().value_or(0.0);
  const auto& slopes = options.alibi_slopes();
  const auto& table = options.position_bias();
  if (slopes.defined() || table.defined()) {
    const auto device = (slopes.defined() ? slopes : table).device();
    // Index w of the L + S - 1 distances j - i' = w - (L - 1) - query_offset.
    const int64_t count = std::max<int64_t>(L + S - 1, 0);
    const auto distances = torch::arange(count, torch::dtype(torch::kLong).device(device)) -
        (L - 1) - options.query_offset();
    torch::Tensor bias = torch::zeros({H, count}, torch::dtype(torch::kDouble).device(device));
    if (slopes.defined()) {
      bias = bias + alibi_bias(slopes, distances, options.alibi_symmetric());
    }
    if (table.defined()) {
      bias = bias +
          table.to(torch::kDouble)
              .index_select(1, position_buckets(distances, options.position_buckets()));
    }
    modifiers.offset_bias = bias.to(dtype);
    TORCH_CHECK(
        torch::isfinite(modifiers.offset_bias.detach()).all().item<bool>(),
        "scaled_dot_product_attention: alibi_slopes times the distances (up to ",
        std::max(
            std::abs(L - 1 + options.query_offset()), std::abs(S - 1 - options.query_offset())),
        " keys) and position_bias add a bias beyond the range of ", dtype);
  }
  if (options.sinks().defined()) {
    modifiers.sinks = options.sinks().to(dtype);
  }
  if (const auto& function = options.score_function()) {
    modifiers.user = std::make_shared<const UserScoreFunction>(
        UserScoreFunction{function->value, function->derivative});
  }
  return modifiers;
}

} // namespace attn::detail
