// Packed sequences and block masks, timed side by side in one process that
// sets no thread variables (time_interleaved: medians over rounds of
// alternating order) with the peak tensor memory of one call:
//
//   build/bench/attn_packing_bench [--quick]
//
// - key padding: a bool (B, 1, 1, S) mask hiding the last quarter of the
//   keys (B = 2, H = 12, T = 1024, D = 64), attn against
//   at::scaled_dot_product_attention with the same mask, forward and
//   forward+backward, float32 and bfloat16;
// - packed documents: lengths drawn uniformly from 32..1024 (seeded),
//   packed into rows of 4096 tokens, causal within each document, H = 12,
//   D = 64, forward+backward: attn::varlen_attention against the same
//   documents padded to the longest with a key-padding mask, a dense
//   block-diagonal bool mask over the rows on attn's kernel, and
//   at::scaled_dot_product_attention with that mask;
// - causal attention through a block mask against is_causal;
// - building a document and a prefix-LM block mask at T = 4096 against one
//   forward of that size.

#include <attn/attn.h>

#include "runtime/compat.h" // whether LibTorch has its own attention
#include "timing.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using attn::bench::fixed;
using attn::bench::peak_mib;
using attn::bench::Step;
using attn::bench::time_interleaved;

constexpr int64_t kHeads = 12, kWidth = 64;

// A step that runs `forward` with grad and backward() of its sum, or
// without grad.
template <typename Forward>
Step step_of(bool backward, Forward forward) {
  if (backward) {
    return [forward] { forward().sum().backward(); };
  }
  return [forward] {
    const torch::NoGradGuard no_grad;
    forward();
  };
}

torch::Tensor heads(int64_t B, int64_t T, torch::ScalarType dtype, bool grad) {
  return torch::randn({B, kHeads, T, kWidth}).to(dtype).requires_grad_(grad);
}

// A table row: each step's median time and peak tensor memory (or "–"
// where `with_memory` is false: LibTorch's bfloat16 backward fails under
// the counting allocator), then each step's time over the first's.
void print_row(
    const std::string& name,
    const std::vector<Step>& steps,
    double budget,
    bool with_memory = true) {
  const auto seconds = time_interleaved(steps, budget);
  std::printf("| %s |", name.c_str());
  for (size_t i = 0; i < steps.size(); ++i) {
    std::printf(
        " %.1f | %s |", seconds[i] * 1e3,
        with_memory ? fixed(peak_mib(steps[i]), "%.0f").c_str() : "–");
  }
  for (size_t i = 1; i < steps.size(); ++i) {
    std::printf(" %s |", fixed(seconds[i] / seconds[0], "%.2f×").c_str());
  }
  std::printf("\n");
  std::fflush(stdout);
}

void key_padding(double budget) {
  std::printf(
      "\nKey padding, B = 2, H = 12, T = 1024, D = 64, last quarter of the keys padded\n\n"
      "| case | attn ms | attn MiB | at::sdpa ms | at::sdpa MiB | at::sdpa ÷ attn |\n"
      "|---|---|---|---|---|---|\n");
  const int64_t B = 2, T = 1024;
  const auto padding = (torch::arange(T) < T - T / 4).view({1, 1, 1, T}).expand({B, 1, 1, T});
  // bfloat16 first: once the counting allocator is in place (the first
  // peak measured), LibTorch's bfloat16 backward fails its allocation check.
  for (const auto dtype : {torch::kBFloat16, torch::kFloat}) {
    for (const bool backward : {false, true}) {
      torch::manual_seed(0);
      const auto q = heads(B, T, dtype, backward), k = heads(B, T, dtype, backward),
                 v = heads(B, T, dtype, backward);
      const std::vector<Step> steps{
          step_of(
              backward,
              [=] {
                return std::get<0>(attn::scaled_dot_product_attention(
                    q, k, v, attn::SDPAOptions().attn_mask(padding)));
              }),
          step_of(backward, [=] {
            return attn::detail::native_attention(q, k, v, 0.0, false, c10::nullopt, padding);
          })};
      print_row(
          std::string(c10::toString(dtype)) + (backward ? " fwd+bwd" : " fwd"), steps, budget,
          dtype == torch::kFloat);
    }
  }
}

// Document lengths drawn uniformly from 32..1024, packed into `rows` rows
// of `row_length` tokens (a row's last document cut to fit).
std::vector<std::vector<int64_t>> packed_documents(int64_t rows, int64_t row_length) {
  std::mt19937 generator(42);
  std::uniform_int_distribution<int64_t> length(32, 1024);
  std::vector<std::vector<int64_t>> packed(rows);
  for (auto& row : packed) {
    int64_t used = 0;
    while (used < row_length) {
      row.push_back(std::min(length(generator), row_length - used));
      used += row.back();
    }
  }
  return packed;
}

// The documents' sequence starts, one sequence after the other.
torch::Tensor sequence_starts(const std::vector<std::vector<int64_t>>& rows) {
  std::vector<int64_t> starts{0};
  for (const auto& row : rows) {
    for (const int64_t length : row) {
      starts.push_back(starts.back() + length);
    }
  }
  return torch::tensor(starts);
}

// (rows, 1, T, T) bool: causal within each document of each row.
torch::Tensor block_diagonal(const std::vector<std::vector<int64_t>>& rows, int64_t T) {
  auto mask = torch::zeros({static_cast<int64_t>(rows.size()), 1, T, T}, torch::kBool);
  for (size_t r = 0; r < rows.size(); ++r) {
    int64_t start = 0;
    for (const int64_t length : rows[r]) {
      mask[r][0]
          .narrow(0, start, length)
          .narrow(1, start, length)
          .copy_(torch::ones({length, length}, torch::kBool).tril());
      start += length;
    }
  }
  return mask;
}

void packed(double budget, bool quick) {
  const int64_t rows = 2, T = 4096;
  const auto documents = packed_documents(rows, T);
  const auto starts = sequence_starts(documents);
  const int64_t count = starts.numel() - 1;
  const int64_t longest =
      (starts.narrow(0, 1, count) - starts.narrow(0, 0, count)).max().item<int64_t>();
  std::printf(
      "\nPacked documents: %lld documents of 32..1024 tokens in %lld rows of %lld, the longest "
      "%lld, causal within each, H = 12, D = 64, float32, fwd+bwd\n\n"
      "| case | packed ms | MiB | padded ms | MiB | padded, padding computed ms | MiB | dense "
      "mask ms | MiB | dense mask, every block computed ms | MiB |%s padded ÷ packed | padded, "
      "computed ÷ packed | dense ÷ packed | dense, computed ÷ packed |%s\n"
      "|---|---|---|---|---|---|---|---|---|---|---|%s---|---|---|---|%s\n",
      static_cast<long long>(count), static_cast<long long>(rows), static_cast<long long>(T),
      static_cast<long long>(longest), quick ? "" : " at::sdpa ms | at::sdpa MiB |",
      quick ? "" : " at::sdpa ÷ packed |", quick ? "" : "---|---|", quick ? "" : "---|");
  torch::manual_seed(0);
  const auto q = torch::randn({rows * T, kHeads, kWidth}).requires_grad_();
  const auto k = torch::randn({rows * T, kHeads, kWidth}).requires_grad_();
  const auto v = torch::randn({rows * T, kHeads, kWidth}).requires_grad_();
  // Padded: one batch row per document, keys past its length masked.
  const auto padded_q = heads(count, longest, torch::kFloat, true);
  const auto padded_k = heads(count, longest, torch::kFloat, true);
  const auto padded_v = heads(count, longest, torch::kFloat, true);
  const auto lengths =
      (starts.narrow(0, 1, count) - starts.narrow(0, 0, count)).view({count, 1, 1, 1});
  const auto key_padding = torch::arange(longest).view({1, 1, 1, longest}) < lengths;
  // Dense: the rows with a block-diagonal mask.
  const auto dense_q = heads(rows, T, torch::kFloat, true),
             dense_k = heads(rows, T, torch::kFloat, true),
             dense_v = heads(rows, T, torch::kFloat, true);
  const auto dense = block_diagonal(documents, T);
  // The same masks as additive float masks (0 or -inf), whose blocks the
  // kernel does not classify: every block computed, as bool masks were
  // before the kernels skipped their empty blocks.
  const auto additive = [](const torch::Tensor& mask) {
    return torch::zeros(mask.sizes()).masked_fill(mask.logical_not(), -INFINITY);
  };
  const auto padded_step = [=](const torch::Tensor& mask) {
    return step_of(true, [=] {
      return std::get<0>(attn::scaled_dot_product_attention(
          padded_q, padded_k, padded_v, attn::SDPAOptions().is_causal(true).attn_mask(mask)));
    });
  };
  const auto dense_step = [=](const torch::Tensor& mask) {
    return step_of(true, [=] {
      return std::get<0>(attn::scaled_dot_product_attention(
          dense_q, dense_k, dense_v, attn::SDPAOptions().attn_mask(mask)));
    });
  };
  std::vector<Step> steps{
      step_of(
          true,
          [=] {
            return attn::varlen_attention(
                q, k, v, attn::PackedSequences(starts), attn::SDPAOptions().is_causal(true));
          }),
      padded_step(key_padding), padded_step(additive(key_padding)), dense_step(dense),
      dense_step(additive(dense))};
  if (!quick && attn::detail::kHasNativeAttention) {
    steps.push_back(step_of(true, [=] {
      return attn::detail::native_attention(
          dense_q, dense_k, dense_v, 0.0, false, c10::nullopt, dense);
    }));
  }
  print_row("causal documents", steps, budget);
}

void causal_through_a_block_mask(double budget) {
  std::printf(
      "\nCausal attention, B = 1, H = 12, T = 2048, D = 64, float32\n\n"
      "| case | is_causal ms | MiB | block mask ms | MiB | block mask ÷ is_causal |\n"
      "|---|---|---|---|---|---|\n");
  const int64_t T = 2048;
  torch::manual_seed(0);
  const auto mask = attn::block_mask(attn::causal_mask(), 1, 1, T, T);
  for (const bool backward : {false, true}) {
    const auto q = heads(1, T, torch::kFloat, backward), k = heads(1, T, torch::kFloat, backward),
               v = heads(1, T, torch::kFloat, backward);
    const std::vector<Step> steps{
        step_of(
            backward,
            [=] {
              return std::get<0>(
                  attn::scaled_dot_product_attention(q, k, v, attn::SDPAOptions().is_causal(true)));
            }),
        step_of(backward, [=] {
          return std::get<0>(
              attn::scaled_dot_product_attention(q, k, v, attn::SDPAOptions().block_mask(mask)));
        })};
    print_row(backward ? "fwd+bwd" : "fwd", steps, budget);
  }
}

void building(double budget) {
  std::printf(
      "\nBuilding a block mask at T = 4096 against one forward (B = 1, H = 12, D = 64, "
      "float32, causal documents)\n\n"
      "| case | forward ms | MiB | document mask ms | MiB | prefix-LM mask ms | MiB | "
      "document ÷ forward | prefix-LM ÷ forward |\n"
      "|---|---|---|---|---|---|---|---|---|\n");
  const int64_t T = 4096;
  const auto documents = packed_documents(1, T);
  const auto starts = sequence_starts(documents);
  const auto ids = torch::bucketize(
      torch::arange(T), starts.narrow(0, 1, starts.numel() - 1), false, true);
  const auto document = attn::block_mask(
      attn::causal_mask() & attn::document_mask(ids), 1, 1, T, T);
  torch::manual_seed(0);
  const auto q = heads(1, T, torch::kFloat, false), k = heads(1, T, torch::kFloat, false),
             v = heads(1, T, torch::kFloat, false);
  const std::vector<Step> steps{
      step_of(
          false,
          [=] {
            return std::get<0>(attn::scaled_dot_product_attention(
                q, k, v, attn::SDPAOptions().block_mask(document)));
          }),
      [=] { attn::block_mask(attn::causal_mask() & attn::document_mask(ids), 1, 1, T, T); },
      [=] { attn::block_mask(attn::prefix_lm_mask(torch::tensor({1000})), 1, 1, T, T); }};
  print_row("build", steps, budget);
}

} // namespace

int main(int argc, char** argv) {
  double budget = 1.5;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      budget = 0.3;
      quick = true;
    } else {
      std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]);
      return 2;
    }
  }
  std::printf("LibTorch %s, ATen threads %d\n", TORCH_VERSION, at::get_num_threads());
  if (attn::detail::kHasNativeAttention) {
    key_padding(budget);
  }
  packed(budget, quick);
  causal_through_a_block_mask(budget);
  building(budget);
  return 0;
}
