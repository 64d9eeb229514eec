#pragma once

// The catalogue of bad and unusual inputs to attn's public functions and
// modules, case for case as in docs/BAD_INPUTS.md: each case is a call with
// the c10::Error message it raises, or a call that works and checks its own
// result. Each case is written here once: BadInputs (test_bad_inputs.cpp)
// runs every table, and each entry point's own suite runs its table's
// errors.

#include <functional>
#include <string>
#include <vector>

namespace attn::testing {

struct BadInput {
  std::string name;           // the case, as docs/BAD_INPUTS.md names it
  std::function<void()> call; // checks its own result when it works
  std::string error;          // part of the c10::Error message; empty: the call works
};

// Expects each case's outcome: its error, or no error.
void expect_catalogued_outcomes(const std::vector<BadInput>& cases);

// The cases of `cases` that raise an error.
std::vector<BadInput> error_cases(std::vector<BadInput> cases);

// One table per entry point, in docs/BAD_INPUTS.md's order.
std::vector<BadInput> scaled_dot_product_attention_cases();
std::vector<BadInput> scaled_dot_product_attention_module_cases();
std::vector<BadInput> block_mask_cases();
std::vector<BadInput> varlen_attention_cases();
std::vector<BadInput> packed_multi_head_attention_cases();
std::vector<BadInput> multi_head_attention_construction_cases();
std::vector<BadInput> multi_head_attention_forward_cases();
std::vector<BadInput> multi_head_attention_function_cases();
std::vector<BadInput> unknown_device_cases();
// Requests for CUDA: errors only where CUDA is not available.
std::vector<BadInput> unavailable_cuda_cases();
std::vector<BadInput> copy_weights_cases();

} // namespace attn::testing
