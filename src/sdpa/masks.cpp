#include "sdpa/masks.h"

#include <torch/torch.h>

#include <limits>
#include <vector>

namespace attn::detail {

torch::Tensor visible_band(
    int64_t L,
    int64_t S,
    int64_t query_offset,
    bool causal,
    const c10::optional<int64_t>& window,
    torch::Device device) {
  return visible_band(
      KeyBand{causal, query_offset, std::min(window.value_or(0), kUnboundedWindow), S}, L, device);
}

torch::Tensor visible_band(const KeyBand& band, int64_t L, torch::Device device) {
  const int64_t S = band.S;
  // Each query's bounds (L, 1) against the key positions (1, S): the
  // comparisons broadcast straight to the (L, S) band.
  auto begin = torch::empty({L, 1}, torch::kLong);
  auto end = torch::empty({L, 1}, torch::kLong);
  auto* begin_data = begin.data_ptr<int64_t>();
  auto* end_data = end.data_ptr<int64_t>();
  for (int64_t i = 0; i < L; ++i) {
    begin_data[i] = band.begin(i);
    end_data[i] = band.end(i);
  }
  const auto key = torch::arange(S, torch::TensorOptions(torch::kLong).device(device));
  return key.ge(begin.to(device)).logical_and_(key.lt(end.to(device)));
}

void check_mask_dtype_and_device(
    const char* caller,
    const char* name,
    const torch::Tensor& mask,
    const torch::Tensor& query) {
  TORCH_CHECK(
      mask.scalar_type() == torch::kBool || mask.scalar_type() == query.scalar_type(), caller, ": ",
      name, " must be bool or have the query's dtype ", query.scalar_type(), ", got ",
      mask.scalar_type());
  TORCH_CHECK(
      mask.device() == query.device(), caller, ": ", name, " must be on the query's device ",
      query.device(), ", got ", mask.device());
}

torch::Tensor as_additive_mask(const torch::Tensor& mask, torch::ScalarType dtype) {
  if (mask.scalar_type() != torch::kBool) {
    return mask;
  }
  return torch::zeros(mask.sizes(), torch::TensorOptions(dtype).device(mask.device()))
      .masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
}

torch::Tensor intersect_masks(std::initializer_list<torch::Tensor> masks, torch::ScalarType dtype) {
  std::vector<torch::Tensor> defined;
  bool all_bool = true;
  for (const auto& mask : masks) {
    if (mask.defined()) {
      defined.push_back(mask);
      all_bool = all_bool && mask.scalar_type() == torch::kBool;
    }
  }
  if (defined.size() < 2) {
    return defined.empty() ? torch::Tensor() : defined.front();
  }
  auto result = all_bool ? defined.front() : as_additive_mask(defined.front(), dtype);
  for (size_t i = 1; i < defined.size(); ++i) {
    result = all_bool ? result.logical_and(defined[i])
                      : result + as_additive_mask(defined[i], dtype);
  }
  return result;
}

bool needs_explicit_mask(const SDPAOptions& options, int64_t L, int64_t S) {
  return options.attn_mask().defined() || options.window() ||
      (options.is_causal() && (L != S || options.query_offset() != 0));
}

torch::Tensor explicit_mask(
    const SDPAOptions& options,
    int64_t L,
    int64_t S,
    torch::ScalarType dtype,
    torch::Device device) {
  const bool banded = options.is_causal() || options.window();
  return intersect_masks(
      {options.attn_mask(),
       banded ? visible_band(
                    L, S, options.query_offset(), options.is_causal(), options.window(), device)
              : torch::Tensor()},
      dtype);
}

MaskWithoutEmptyRows without_empty_rows(const torch::Tensor& mask) {
  if (mask.scalar_type() == torch::kBool) {
    const auto empty_rows = mask.logical_not().all(-1, /*keepdim=*/true);
    return {mask.logical_or(empty_rows), empty_rows};
  }
  const auto empty_rows =
      mask.eq(-std::numeric_limits<double>::infinity()).all(-1, /*keepdim=*/true);
  return {mask.masked_fill(empty_rows, 0.0), empty_rows};
}

torch::Tensor allow_extra_keys(const torch::Tensor& mask, int64_t extra) {
  auto sizes = mask.sizes().vec();
  sizes.back() = extra;
  const auto allowed = mask.scalar_type() == torch::kBool ? torch::ones(sizes, mask.options())
                                                          : torch::zeros(sizes, mask.options());
  return torch::cat({mask, allowed}, -1);
}

} // namespace attn::detail
