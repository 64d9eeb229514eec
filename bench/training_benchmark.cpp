// attn against torch::nn::MultiheadAttention at the shapes training runs,
// forward and forward+backward, in a process that sets no thread variables:
// the thread pools are what LibTorch and the BLAS start with, as in a user's
// program.
//
//   build/bench/attn_training_bench [--quick] [--filter SUBSTRING[,SUBSTRING...]]
//   build/bench/attn_training_bench --kernels   # the CPU kernels on short sequences
//   build/bench/attn_training_bench --kernels --cpu-capability avx2
//                                               # ... attn's at one CPU
//                                               # capability (attn/backend.h)
//   build/bench/attn_training_bench --products  # the tiled kernel's products:
//                                               # attn's loops per instruction
//                                               # set against BLAS, and the bfloat16
//                                               # products against float32 and at::mm
//   build/bench/attn_training_bench --dropout   # training with dropout: time
//                                               # and peak tensor memory
//   build/bench/attn_training_bench --modifiers # published models' attention
//                                               # (ALiBi, soft-cap, T5's table,
//                                               # sinks, dropout): time, memory
//
// Each case builds both modules with the same weights and times them
// interleaved, in rounds that alternate which goes first; a round times
// several calls of each. The table gives each one's median time per call
// over the rounds and the ratio builtin ÷ attn (above 1: attn is faster),
// and the rates as a share of the sgemm rate measured just before and
// after the case (the machine drifts).
//
// FLOPs: attention 4·B·H·T²·D (halved when causal), each of the four
// projections 2·B·T·E²; forward+backward counts 3× the forward.

#include <attn/attn.h>

#include "kernels/cpu/isa.h"          // the CPU levels and their loops
#include "kernels/cpu/micro_tile.h"   // the bfloat16 products' operands
#include "kernels/cpu/tile_product.h" // the tiled kernel's products, attn's loops or BLAS's
#include "naive_attention.h"
#include "peak_memory.h"
#include "runtime/compat.h" // whether LibTorch has its own attention
#include "timing.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace {

using attn::bench::Clock;
using attn::bench::fixed;
using attn::bench::median;
using attn::bench::peak_mib;
using attn::bench::seconds_since;
using attn::bench::Step;
using attn::bench::time_interleaved;

struct Case {
  std::string name;
  int64_t E, H, B, T;
  bool causal;
  bool backward;
  bool core_only = false; // the attention core (B, H, T, E/H), no projections
};

std::string label(const Case& c) {
  char text[160];
  std::snprintf(
      text, sizeof text, "%s E=%lld H=%lld B=%lld T=%lld%s %s", c.name.c_str(),
      static_cast<long long>(c.E), static_cast<long long>(c.H), static_cast<long long>(c.B),
      static_cast<long long>(c.T), c.causal ? " causal" : "", c.backward ? "fwd+bwd" : "fwd");
  return text;
}

double flops(const Case& c) {
  const double attention = 4.0 * c.B * c.T * c.T * c.E / (c.causal ? 2.0 : 1.0);
  const double projections = c.core_only ? 0.0 : 4 * 2.0 * c.B * c.T * c.E * c.E;
  return (attention + projections) * (c.backward ? 3.0 : 1.0);
}

// A step that runs `forward` and, for a backward case, backward() of the
// output's sum; a forward case runs without grad.
template <typename Forward>
Step make_step(const Case& c, Forward forward) {
  if (c.backward) {
    return [forward]() mutable { forward().sum().backward(); };
  }
  return [forward]() mutable {
    const torch::NoGradGuard no_grad;
    forward();
  };
}

// A case's steps: attn's module, the built-in, and the four projections
// alone (one (3E, E) and one (E, E) GEMM with their biases), which both
// modules compute and no attention kernel can make faster.
std::vector<Step> module_steps(const Case& c) {
  torch::manual_seed(0);
  attn::MultiHeadAttention ours(attn::MultiHeadAttentionOptions(c.E, c.H));
  torch::nn::MultiheadAttention builtin(torch::nn::MultiheadAttentionOptions(c.E, c.H));
  attn::copy_weights(*ours, *builtin);
  const auto x = torch::randn({c.B, c.T, c.E}).requires_grad_(c.backward);
  const auto x_seq_first = x.detach().transpose(0, 1).contiguous().requires_grad_(c.backward);
  // The built-in takes a causal mask as an additive float mask.
  const auto causal_bias = c.causal
      ? torch::full({c.T, c.T}, -std::numeric_limits<float>::infinity()).triu(1)
      : torch::Tensor();
  const auto options = attn::MultiHeadAttentionForwardOptions().is_causal(c.causal).need_weights(
      false);
  const auto in_weight = builtin->in_proj_weight.detach().clone().requires_grad_(c.backward);
  const auto in_bias = builtin->in_proj_bias.detach().clone().requires_grad_(c.backward);
  const auto out_weight = builtin->out_proj->weight.detach().clone().requires_grad_(c.backward);
  const auto out_bias = builtin->out_proj->bias.detach().clone().requires_grad_(c.backward);
  const int64_t E = c.E;
  return {
      make_step(
          c, [ours, x, options]() mutable { return std::get<0>(ours->forward(x, x, x, options)); }),
      make_step(
          c,
          [builtin, x_seq_first, causal_bias]() mutable {
            return std::get<0>(builtin->forward(
                x_seq_first, x_seq_first, x_seq_first, torch::Tensor(), /*need_weights=*/false,
                causal_bias));
          }),
      make_step(c, [x, in_weight, in_bias, out_weight, out_bias, E] {
        const auto qkv = torch::nn::functional::linear(x, in_weight, in_bias);
        return torch::nn::functional::linear(qkv.narrow(2, 0, E), out_weight, out_bias);
      })};
}

// The attention core: attn's default choice against the textbook
// composite, on (B, H, T, D).
std::vector<Step> core_steps(const Case& c) {
  torch::manual_seed(0);
  const int64_t D = c.E / c.H;
  const auto input = [&] { return torch::randn({c.B, c.H, c.T, D}).requires_grad_(c.backward); };
  const auto q = input(), k = input(), v = input();
  const auto lower = c.causal ? torch::ones({c.T, c.T}, torch::kBool).tril() : torch::Tensor();
  const auto options = attn::SDPAOptions().is_causal(c.causal).need_weights(false);
  const auto ours_step = make_step(c, [q, k, v, options] {
    return std::get<0>(attn::scaled_dot_product_attention(q, k, v, options));
  });
  const auto naive_step = make_step(
      c, [q, k, v, lower] { return attn::bench::naive_attention(q, k, v, lower); });
  return {ours_step, naive_step};
}

// The CPU kernels side by side on the core (B·H = 8 or 96 heads, L = S = T),
// for the rule that chooses between them: attn's tiled kernel, its batched
// one and, on LibTorch 2.x, LibTorch's own; attn's at `capability`.
void compare_kernels(double budget, attn::CpuCapability capability) {
  using attn::AttentionBackend;
  std::vector<AttentionBackend> backends = {
      AttentionBackend::fused_cpu, AttentionBackend::batched_cpu};
  if (attn::detail::kHasNativeAttention) {
    backends.push_back(AttentionBackend::libtorch);
  }
  std::printf("| pass | causal | D | T | B·H |");
  for (const auto backend : backends) {
    std::printf(" %s ms |", attn::backend_name(backend));
  }
  // Below 1: attn's fused kernel (its short loops up to 64 keys) is the faster.
  std::printf(" fused_cpu ÷ batched_cpu |");
  if (backends.size() > 2) {
    std::printf(" fused_cpu ÷ libtorch |");
  }
  std::printf("\n|---|---|---|---|---|");
  for (size_t i = 0; i < 2 * backends.size() - 1; ++i) {
    std::printf("---|");
  }
  std::printf("\n");
  for (const bool backward : {false, true}) {
    for (const bool causal : {false, true}) {
      for (const int64_t D : {16, 64}) {
        for (const int64_t T : {16, 32, 64, 96, 128, 256}) {
          for (const int64_t heads : {8, 96}) {
            const Case c{"kernels", 8 * D, 8, heads / 8, T, causal, backward, true};
            const auto input = [&] {
              return torch::randn({c.B, 8, T, D}).requires_grad_(backward);
            };
            const auto q = input(), k = input(), v = input();
            std::vector<Step> steps;
            for (const auto backend : backends) {
              const auto options = attn::SDPAOptions()
                                       .is_causal(causal)
                                       .need_weights(false)
                                       .backend(backend)
                                       .cpu_capability(capability);
              steps.push_back(make_step(c, [q, k, v, options] {
                return std::get<0>(attn::scaled_dot_product_attention(q, k, v, options));
              }));
            }
            const auto seconds = time_interleaved(steps, budget);
            std::printf(
                "| %s | %s | %lld | %lld | %lld |", backward ? "fwd+bwd" : "fwd",
                causal ? "yes" : "no", static_cast<long long>(D), static_cast<long long>(T),
                static_cast<long long>(heads));
            for (const double time : seconds) {
              std::printf(" %.3f |", time * 1e3);
            }
            for (size_t other = 1; other < seconds.size(); ++other) {
              std::printf(" %.2f× |", seconds[0] / seconds[other]);
            }
            std::printf("\n");
            std::fflush(stdout);
          }
        }
      }
    }
  }
}

// The tiled kernel on the core (B·H = 8, D = 64, L = S = T) with each of
// the float products this CPU can run (tile_product.h: attn's loops for
// each instruction set, the BLAS's at capability portable) side by side;
// the rates as a share of the same run's sgemm rate.
void compare_products(double budget, double sgemm) {
  std::vector<attn::CpuCapability> loops;
  for (const auto capability : attn::cpu_capabilities()) {
    if (capability <= attn::CpuCapability::avx512) { // the float products' levels
      loops.insert(loops.begin(), capability);       // the widest first
    }
  }
  std::printf("| pass | causal | T |");
  for (const auto each : loops) {
    std::printf(" %s ms | %% of sgemm |", attn::cpu_capability_name(each));
  }
  std::printf(
      " %s ÷ %s |\n|---|---|---|", attn::cpu_capability_name(loops.back()),
      attn::cpu_capability_name(loops.front()));
  for (size_t i = 0; i < loops.size(); ++i) {
    std::printf("---|---|");
  }
  std::printf("---|\n");
  for (const bool backward : {false, true}) {
    for (const bool causal : {false, true}) {
      for (const int64_t T : {256, 512, 1024, 2048, 4096}) {
        const Case c{"products", 512, 8, 1, T, causal, backward, true};
        const auto input = [&] { return torch::randn({1, 8, T, 64}).requires_grad_(backward); };
        const auto q = input(), k = input(), v = input();
        std::vector<Step> steps;
        for (const auto each : loops) {
          const auto options = attn::SDPAOptions()
                                   .is_causal(causal)
                                   .need_weights(false)
                                   .backend(attn::AttentionBackend::fused_cpu)
                                   .cpu_capability(each);
          steps.push_back(make_step(c, [q, k, v, options] {
            return std::get<0>(attn::scaled_dot_product_attention(q, k, v, options));
          }));
        }
        const auto seconds = time_interleaved(steps, budget);
        const double gflop = flops(c) / 1e9;
        std::printf(
            "| %s | %s | %lld |", backward ? "fwd+bwd" : "fwd", causal ? "yes" : "no",
            static_cast<long long>(T));
        for (const double time : seconds) {
          std::printf(" %.3f | %.0f %% |", time * 1e3, 100 * gflop / time / sgemm);
        }
        std::printf(" %.2f× |\n", seconds.back() / seconds.front());
        std::fflush(stdout);
      }
    }
  }
}

// attn's bfloat16 products, accumulated in float (AVX512-BF16's micro-tiles
// and AMX tiles, where this CPU runs them), against its float32 loops and
// LibTorch's own bfloat16 GEMM (at::mm), at the shapes of the tiled
// kernel's products (m × n × depth: scores 128 × 512 × 64, P·V
// 128 × 64 × 512, the backward's dK and dV 512 × 64 × 128), on one thread
// as a kernel's task runs them: GFLOP/s. b is packed in pairs once, as the
// kernels would pack K and V once per call.
void compare_bf16_products(double budget) {
  using attn::detail::Bf16GemmOperands;
  using attn::detail::CpuLevel;
  const auto& levels = attn::detail::cpu_levels();
  const auto runs = [&](CpuLevel level) {
    return std::find(levels.begin(), levels.end(), level) != levels.end();
  };
  const bool avx512_bf16 = runs(CpuLevel::avx512_bf16);
  const bool amx = runs(CpuLevel::amx);
  const auto float_loops = attn::detail::cpu_loops(std::min(levels.back(), CpuLevel::avx512));
  // A level this CPU lacks: loops without bfloat16 products, which compute
  // nothing (its column prints "–").
  const auto bf16_loops = avx512_bf16 ? attn::detail::cpu_loops(CpuLevel::avx512_bf16)
                                      : attn::detail::CpuLoops{};
  const auto amx_loops = amx ? attn::detail::cpu_loops(CpuLevel::amx) : attn::detail::CpuLoops{};
  const int previous_threads = at::get_num_threads();
  at::set_num_threads(1);
  std::printf(
      "bfloat16 products, one thread each (GFLOP/s; AVX512-BF16 %s, AMX %s):\n\n"
      "| m × n × depth | float32 loops | AVX512-BF16 loops | AMX tiles | at::mm bfloat16 | AMX "
      "÷ float32 loops | AMX ÷ at::mm |\n|---|---|---|---|---|---|---|\n",
      avx512_bf16 ? "runs" : "absent", amx ? "granted" : "absent");
  for (const auto& [m, n, depth] :
       std::vector<std::array<int64_t, 3>>{{128, 512, 64}, {128, 64, 512}, {512, 64, 128}}) {
    const auto a = torch::randn({m, depth}), b = torch::randn({depth, n});
    const auto a16 = a.to(torch::kBFloat16), b16 = b.to(torch::kBFloat16);
    const auto packed = torch::empty({(depth + 1) / 2, 2 * n}, torch::kBFloat16);
    attn::detail::pack_bf16_pairs(
        float_loops, depth, n, b16.data_ptr<c10::BFloat16>(), n, 1,
        packed.data_ptr<c10::BFloat16>(), 2 * n);
    const auto c = torch::empty({m, n});
    const Bf16GemmOperands g{
        depth,
        1.0F,
        reinterpret_cast<const uint16_t*>(a16.data_ptr<c10::BFloat16>()),
        depth,
        reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
        2 * n,
        c.data_ptr<float>(),
        n,
        false};
    const std::vector<Step> steps{
        [&] {
          attn::detail::tile_gemm_float(
              float_loops, m, n, depth, 1.0F, a.data_ptr<float>(), depth, 1, b.data_ptr<float>(), n,
              c.data_ptr<float>(), n, false);
        },
        [&] { attn::detail::gemm_bf16(bf16_loops, m, n, g); },
        [&] { attn::detail::gemm_bf16(amx_loops, m, n, g); }, [&] { torch::mm(a16, b16); }};
    const auto seconds = time_interleaved(steps, budget);
    const double gflop = 2.0 * static_cast<double>(m * n * depth) / 1e9;
    const auto rate = [&](size_t step, bool runs) {
      return runs ? fixed(gflop / seconds[step], "%.1f") : std::string("–");
    };
    std::printf(
        "| %lld × %lld × %lld | %s | %s | %s | %s | %s | %s |\n", static_cast<long long>(m),
        static_cast<long long>(n), static_cast<long long>(depth), rate(0, true).c_str(),
        rate(1, avx512_bf16).c_str(), rate(2, amx).c_str(), rate(3, true).c_str(),
        amx ? fixed(seconds[0] / seconds[2], "%.2f×").c_str() : "–",
        amx ? fixed(seconds[3] / seconds[2], "%.2f×").c_str() : "–");
    std::fflush(stdout);
  }
  at::set_num_threads(previous_threads);
}

// Training with dropout 0.1 on GPT-2 small's causal layer (E = 768, H =
// 12), forward+backward: attn's module, whose fused kernel drops the
// weights, against the built-in with the same dropout; and the attention
// core on the fused kernel against attn's math path, which held the
// (B, H, T, T) scores, probabilities and mask (the only backend that took
// dropout before), and against the fused kernel without dropout: what
// dropping costs. Times interleaved; the peak of tensor memory of one call
// of each, over what was held before it (PeakTensorMemory).
void compare_dropout(double budget) {
  std::printf(
      "| what | B | T | attn ms | other ms | other ÷ attn | attn peak MiB | other peak MiB |\n"
      "|---|---|---|---|---|---|---|---|\n");
  const std::pair<int64_t, int64_t> shapes[] = {{2, 1024}, {1, 2048}, {1, 4096}};
  for (const auto& [B, T] : shapes) {
    const Case c{"gpt2_small", 768, 12, B, T, /*causal=*/true, /*backward=*/true};
    torch::manual_seed(0);
    attn::MultiHeadAttention ours(attn::MultiHeadAttentionOptions(c.E, c.H).dropout(0.1));
    torch::nn::MultiheadAttention builtin(
        torch::nn::MultiheadAttentionOptions(c.E, c.H).dropout(0.1));
    attn::copy_weights(*ours, *builtin);
    const auto x = torch::randn({B, T, c.E}).requires_grad_();
    const auto x_seq_first = x.detach().transpose(0, 1).contiguous().requires_grad_();
    const auto causal_bias = torch::full({T, T}, -std::numeric_limits<float>::infinity()).triu(1);
    const auto causal = attn::MultiHeadAttentionForwardOptions().is_causal(true);
    const std::vector<Step> modules{
        make_step(c, [ours, x, causal]() mutable { return std::get<0>(ours(x, x, x, causal)); }),
        make_step(c, [builtin, x_seq_first, causal_bias]() mutable {
          return std::get<0>(
              builtin(x_seq_first, x_seq_first, x_seq_first, torch::Tensor(), false, causal_bias));
        })};
    const auto heads = [&] { return torch::randn({B, c.H, T, c.E / c.H}).requires_grad_(); };
    const auto q = heads(), k = heads(), v = heads();
    const auto core = [&](const attn::SDPAOptions& options) {
      return make_step(c, [q, k, v, options] {
        return std::get<0>(attn::scaled_dot_product_attention(q, k, v, options));
      });
    };
    const auto fused = attn::SDPAOptions().is_causal(true).backend(
        attn::AttentionBackend::fused_cpu);
    const auto dropout = attn::SDPAOptions(fused).dropout_p(0.1).training(true);
    const std::vector<Step> against_math{
        core(dropout), core(attn::SDPAOptions(dropout).backend(attn::AttentionBackend::math))};
    const std::vector<Step> against_none{core(dropout), core(fused)};
    for (const auto& [what, steps] :
         {std::pair<const char*, std::vector<Step>>{"module ÷ built-in", modules},
          std::pair<const char*, std::vector<Step>>{"core: fused_cpu ÷ math", against_math},
          std::pair<const char*, std::vector<Step>>{
              "core: with ÷ without dropout (fused_cpu)", against_none}}) {
      const auto seconds = time_interleaved(steps, budget);
      std::printf(
          "| %s | %lld | %lld | %.1f | %.1f | %.2f× | %.0f | %.0f |\n", what,
          static_cast<long long>(B), static_cast<long long>(T), seconds[0] * 1e3, seconds[1] * 1e3,
          seconds[1] / seconds[0], peak_mib(steps[0]), peak_mib(steps[1]));
      std::fflush(stdout);
    }
  }
}

// One attention of a published model, as its core (B, H, T, D) computes it.
struct ModelAttention {
  const char* model;
  int64_t B, H, Hkv, D;
  attn::SDPAOptions options; // the modifiers, band and dropout, training
  // The same request without modifiers (dropout and band kept): what the
  // modifiers cost is measured against it. False: the model has none.
  bool has_modifiers;
  // Whether at::scaled_dot_product_attention computes it, with dense_mask.
  bool dense_mask_expresses_it;
};

// ALiBi written as a user's score function: what a C++ modifier costs next
// to the built-in one.
std::shared_ptr<const attn::ScoreFunction> alibi_as_score_function(int64_t heads) {
  const auto slopes_tensor = attn::alibi_slopes(heads).to(torch::kDouble);
  std::vector<double> slopes(
      slopes_tensor.data_ptr<double>(), slopes_tensor.data_ptr<double>() + heads);
  return std::make_shared<attn::ScoreFunction>(attn::ScoreFunction{
      [slopes](double s, int64_t, int64_t h, int64_t i, int64_t j) {
        return s + slopes[static_cast<size_t>(h)] * static_cast<double>(j - i);
      },
      [](double, int64_t, int64_t, int64_t, int64_t) { return 1.0; }});
}

// The rows of the coverage table: attention as each model
// publishes it (T5: Raffel et al. 2020; BLOOM: ALiBi; Gemma 2: soft-cap 50
// with 8 query and 4 key/value heads of width 256; gpt-oss: sinks, 64 query
// and 8 key/value heads, its sliding layers' window of 128; Swin-T's first
// stage: 7×7-token windows as the batch, 3 heads of width 32, its learned
// relative-position table gathered into a (H, 49, 49) bias that requires
// grad).
std::vector<ModelAttention> model_attentions(int64_t T) {
  using attn::PositionBucketing;
  using attn::PositionBuckets;
  using attn::SDPAOptions;
  const auto table = [](int64_t H, const PositionBuckets& buckets) {
    return torch::randn({H, buckets.count()}).requires_grad_();
  };
  const auto t5 = PositionBuckets().num_buckets(32).max_distance(128);
  const auto t5_causal = PositionBuckets(t5).bucketing(PositionBucketing::t5_causal);
  const auto padding = torch::arange(T).view({1, 1, 1, T}) < (T - T / 4); // last quarter padded
  const auto dropout = SDPAOptions().dropout_p(0.1).training(true);
  return {
      {"BERT-base", 1, 12, 12, 64, SDPAOptions(dropout).attn_mask(padding), false, true},
      {"GPT-2 small", 1, 12, 12, 64, SDPAOptions(dropout).is_causal(true), false, true},
      {"T5-base encoder", 1, 12, 12, 64,
       SDPAOptions(dropout).scale(1.0).position_bias(table(12, t5)).position_buckets(t5), true,
       false},
      {"T5-base decoder", 1, 12, 12, 64,
       SDPAOptions(dropout)
           .scale(1.0)
           .is_causal(true)
           .position_bias(table(12, t5_causal))
           .position_buckets(t5_causal),
       true, false},
      {"BLOOM", 1, 16, 16, 64, SDPAOptions().is_causal(true).alibi_slopes(attn::alibi_slopes(16)),
       true, true},
      {"BLOOM, ALiBi as a score_function", 1, 16, 16, 64,
       SDPAOptions().is_causal(true).score_function(alibi_as_score_function(16)), true, false},
      {"Gemma 2", 1, 8, 4, 256,
       SDPAOptions().is_causal(true).enable_gqa(true).softcap(50.0).window(4096), true, false},
      {"gpt-oss (sliding)", 1, 64, 8, 64,
       SDPAOptions().is_causal(true).enable_gqa(true).window(128).sinks(
           torch::randn({64}).requires_grad_()),
       true, false},
  };
}

// Swin-T's first stage: 7×7-token windows as the batch (64 of a 56×56
// image), 3 heads of width 32, its learned relative-position table
// gathered into a (H, 49, 49) bias that requires grad.
ModelAttention swin_block() {
  return {
      "Swin-T block",
      64,
      3,
      3,
      32,
      attn::SDPAOptions().attn_mask(torch::randn({1, 3, 49, 49}).requires_grad_()),
      true,
      false};
}

// The options without the modifiers (a mask that requires grad is one).
attn::SDPAOptions without_modifiers(attn::SDPAOptions options) {
  const auto& mask = options.attn_mask();
  return options.alibi_slopes({})
      .softcap(c10::nullopt)
      .position_bias({})
      .sinks({})
      .score_function(nullptr)
      .attn_mask(mask.defined() ? mask.detach() : mask);
}

// ALiBi (the only modifier at::scaled_dot_product_attention can take, as a
// dense float mask) with the causal band as one additive mask, or the
// options' own mask.
torch::Tensor dense_mask(const attn::SDPAOptions& options, int64_t T) {
  if (!options.alibi_slopes().defined()) {
    return options.attn_mask();
  }
  const auto distance =
      (torch::arange(T).view({1, T}) - torch::arange(T).view({T, 1})).to(torch::kFloat);
  const auto bias = options.alibi_slopes().view({-1, 1, 1}) * distance;
  return options.is_causal()
      ? bias.masked_fill(distance > 0, -std::numeric_limits<float>::infinity())
      : bias;
}

// One row of compare_modifiers.
void measure_model(const ModelAttention& m, int64_t T, double budget) {
  torch::manual_seed(0);
  const auto q = torch::randn({m.B, m.H, T, m.D}).requires_grad_();
  const auto k = torch::randn({m.B, m.Hkv, T, m.D}).requires_grad_();
  const auto v = torch::randn({m.B, m.Hkv, T, m.D}).requires_grad_();
  const auto call = [&](const attn::SDPAOptions& options) -> Step {
    return [q, k, v, options] {
      std::get<0>(attn::scaled_dot_product_attention(q, k, v, options)).sum().backward();
    };
  };
  std::vector<Step> steps{call(m.options)};
  const bool with_math = T <= 2048;
  if (with_math) {
    steps.push_back(call(attn::SDPAOptions(m.options).backend(attn::AttentionBackend::math)));
  }
  if (m.has_modifiers) {
    steps.push_back(call(without_modifiers(m.options)));
  }
  const bool with_native = attn::detail::kHasNativeAttention && m.dense_mask_expresses_it;
  if (with_native) {
    const auto mask = dense_mask(m.options, T);
    const bool causal = m.options.is_causal() && !mask.defined(); // else in the mask
    const double p = m.options.dropout_p();
    steps.push_back([q, k, v, mask, causal, p] {
      attn::detail::native_attention(q, k, v, p, causal, c10::nullopt, mask).sum().backward();
    });
  }
  const auto seconds = time_interleaved(steps, budget);
  size_t next = 1;
  const auto column = [&](bool present) { return present ? seconds[next++] : -1.0; };
  const double math = column(with_math), plain = column(m.has_modifiers),
               native = column(with_native);
  const auto ms = [](double s) { return s < 0 ? std::string("–") : fixed(s * 1e3, "%.1f"); };
  const auto ratio = [&](double s) {
    return s < 0 ? std::string("–") : fixed(s / seconds[0], "%.2f×");
  };
  std::printf(
      "| %s | %lld | %s | %s | %.0f | %s | %s | %s | %s | %s | %s | %s |\n", m.model,
      static_cast<long long>(T), attn::backend_name(attn::select_backend(q, k, v, m.options)),
      ms(seconds[0]).c_str(), peak_mib(steps[0]), ms(math).c_str(), ratio(math).c_str(),
      with_math ? fixed(peak_mib(steps[1]), "%.0f").c_str() : "–", ms(plain).c_str(),
      plain < 0 ? "–" : fixed(seconds[0] / plain, "%.2f×").c_str(), ms(native).c_str(),
      ratio(native).c_str());
  std::fflush(stdout);
}

// Every model's attention on attn's fused kernel, forward+backward at
// T = 1024, 2048 and 4096 (1024 with --quick): time and peak tensor memory
// against attn's math path (up to 2048: beyond it one call takes tens of
// seconds), the same request without its modifiers, and, where a dense mask
// expresses it on LibTorch 2.x, at::scaled_dot_product_attention.
void compare_modifiers(double budget, bool quick) {
  std::printf(
      "| model | T | backend | fused ms | peak MiB | math ms | math ÷ fused | math peak MiB | "
      "without modifiers ms | fused ÷ without | at::sdpa ms | at::sdpa ÷ fused |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const int64_t T :
       quick ? std::vector<int64_t>{1024} : std::vector<int64_t>{1024, 2048, 4096}) {
    for (const auto& m : model_attentions(T)) {
      measure_model(m, T, budget);
    }
  }
  measure_model(swin_block(), 49, budget);
}

double sgemm_gflops() {
  const torch::NoGradGuard no_grad;
  const auto a = torch::randn({1024, 1024}), b = torch::randn({1024, 1024});
  auto out = torch::empty({1024, 1024});
  for (int i = 0; i < 3; ++i) {
    torch::mm_out(out, a, b);
  }
  std::vector<double> rates;
  for (int i = 0; i < 9; ++i) {
    const auto start = Clock::now();
    torch::mm_out(out, a, b);
    rates.push_back(2.0 * 1024 * 1024 * 1024 / seconds_since(start) / 1e9);
  }
  return median(rates);
}

int blas_threads() {
  using Get = int (*)();
  const auto get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return get != nullptr ? get() : -1;
}

std::vector<Case> cases() {
  std::vector<Case> all;
  for (const bool backward : {false, true}) {
    all.push_back({"train_transformer", 64, 4, 64, 16, true, backward});
    all.push_back({"demo", 512, 8, 4, 20, false, backward});
    all.push_back({"batch", 512, 8, 16, 64, false, backward});
    for (const int64_t T : {128, 256, 512, 1024}) {
      all.push_back({"gpt2_small", 768, 12, 8, T, true, backward});
    }
    all.push_back({"mha", 512, 8, 4, 512, false, backward});
    all.push_back({"mha", 512, 8, 1, 2048, false, backward});
    all.push_back({"mha", 512, 8, 1, 4096, false, backward});
  }
  for (const int64_t T : {1024, 2048, 4096}) {
    all.push_back({"core", 512, 8, 1, T, false, false, true});
  }
  return all;
}

// Whether `name` contains one of the comma-separated parts of `filter`.
bool matches(const std::string& name, const std::string& filter) {
  size_t begin = 0;
  while (true) {
    const size_t end = std::min(filter.find(',', begin), filter.size());
    if (name.find(filter.substr(begin, end - begin)) != std::string::npos) {
      return true;
    }
    if (end == filter.size()) {
      return false;
    }
    begin = end + 1;
  }
}

// The CPU capability named `name` ("portable", "avx2", ...), if this CPU
// runs it.
c10::optional<attn::CpuCapability> capability_named(const std::string& name) {
  for (const auto capability : attn::cpu_capabilities()) {
    if (name == attn::cpu_capability_name(capability)) {
      return capability;
    }
  }
  return c10::nullopt;
}

} // namespace

int main(int argc, char** argv) {
  double budget = 1.5;
  std::string filter;
  bool kernels = false, products = false, dropout = false, modifiers = false, quick = false;
  attn::CpuCapability capability = attn::cpu_capabilities().back();
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      budget = 0.3;
      quick = true;
    } else if (std::strcmp(argv[i], "--modifiers") == 0) {
      modifiers = true;
    } else if (std::strcmp(argv[i], "--kernels") == 0) {
      kernels = true;
    } else if (std::strcmp(argv[i], "--products") == 0) {
      products = true;
    } else if (std::strcmp(argv[i], "--dropout") == 0) {
      dropout = true;
    } else if (std::strcmp(argv[i], "--filter") == 0 && i + 1 < argc) {
      filter = argv[++i];
    } else if (std::strcmp(argv[i], "--cpu-capability") == 0 && i + 1 < argc) {
      const auto named = capability_named(argv[++i]);
      if (!named) {
        std::fprintf(
            stderr, "%s: --cpu-capability: this CPU runs no capability named %s\n", argv[0],
            argv[i]);
        return 2;
      }
      capability = *named;
    } else {
      std::fprintf(
          stderr,
          "usage: %s [--quick] [--kernels [--cpu-capability NAME] | --products | --dropout | "
          "--modifiers | "
          "--filter SUBSTRING[,SUBSTRING...]]\n",
          argv[0]);
      return 2;
    }
  }
  const double sgemm = sgemm_gflops();
  const auto& threads = attn::thread_setup();
  std::printf(
      "LibTorch %s, %d CPUs, ATen threads %d (LibTorch started with %d; attn: %s), "
      "BLAS threading %s, OpenBLAS threads %d, OpenBLAS kernels %s, sgemm 1024^3 %.1f "
      "GFLOP/s\n\n",
      TORCH_VERSION, threads.cpus, at::get_num_threads(), threads.threads_found,
      threads.reason.c_str(), threads.blas.c_str(), blas_threads(),
      threads.blas_core.empty() ? "–" : threads.blas_core.c_str(), sgemm);
  if (kernels) {
    std::printf("attn's CPU capability: %s\n\n", attn::cpu_capability_name(capability));
    compare_kernels(budget, capability);
    return 0;
  }
  if (products) {
    compare_products(budget, sgemm);
    std::printf("\n");
    compare_bf16_products(budget);
    return 0;
  }
  if (dropout) {
    compare_dropout(budget);
    return 0;
  }
  if (modifiers) {
    compare_modifiers(budget, quick);
    return 0;
  }
  std::printf(
      "| case | attn ms | builtin ms | builtin ÷ attn | projections ms | ceiling | sgemm "
      "GFLOP/s | attn %% of sgemm | builtin %% of sgemm |\n"
      "|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& c : cases()) {
    const auto name = label(c);
    if (!matches(name, filter)) {
      continue;
    }
    // The machine's speed drifts within minutes: each case is measured
    // against the sgemm rate taken just before and just after it.
    const double sgemm_before = sgemm_gflops();
    const auto seconds = time_interleaved(c.core_only ? core_steps(c) : module_steps(c), budget);
    const double case_sgemm = (sgemm_before + sgemm_gflops()) / 2;
    const double ours = seconds[0], other = seconds[1];
    const double gflop = flops(c) / 1e9;
    // The ceiling: the built-in's time over the projections' alone, the
    // ratio attn would reach with attention taking no time at all.
    const std::string projections = c.core_only ? "–" : fixed(seconds[2] * 1e3, "%.3f");
    const std::string ceiling = c.core_only ? "–" : fixed(other / seconds[2], "%.2f×");
    std::printf(
        "| %s%s | %.3f | %.3f | %.2f× | %s | %s | %.0f | %.0f %% | %.0f %% |\n", name.c_str(),
        c.core_only ? " (vs naive)" : "", ours * 1e3, other * 1e3, other / ours,
        projections.c_str(), ceiling.c_str(), case_sgemm, 100 * gflop / ours / case_sgemm,
        100 * gflop / other / case_sgemm);
    std::fflush(stdout);
  }
  return 0;
}
