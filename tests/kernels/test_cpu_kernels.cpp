// The CPU kernels (src/kernels/cpu), tiled and batched, against the math path: forward,
// weights and gradients over a seeded random sweep of shapes and masks,
// with 1 and 2 threads, and the vectorised exp against libm.

#include "test_support.h"

#include <attn/functional.h>

#include "kernels/cpu/amx_products.h"
#include "kernels/cpu/batched_attention.h"
#include "kernels/cpu/fused_attention.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/micro_tile.h"
#include "kernels/cpu/row_ops.h"
#include "kernels/cpu/short_heads.h"
#include "kernels/cpu/tile_product.h"
#include "kernels/cpu/tiled_attention.h"
#include "kernels/cpu/workspace.h"
#include "sdpa/math_attention.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <thread>

namespace {

using attn::testing::ThreadCount;
using attn::testing::Tolerance;
using attn::testing::tolerance_for;

using attn::detail::FusedLoops;
using attn::testing::kInf;

// The kernels' parameters for q (B, H, L, D), k and v (B, Hkv, S, ·),
// without a mask.
attn::detail::AttentionParams kernel_params(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    double scale,
    bool causal) {
  attn::detail::AttentionParams params;
  params.q = q;
  params.k = k;
  params.v = v;
  params.scale = scale;
  params.causal = causal;
  return params;
}

// One vectorised exp against libm in float64, every tail length, -inf and
// 0 among the inputs; its sum against the portable version's.
void expect_exp_matches_libm(attn::detail::ExpShiftedSumFn vectorised) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-90.0f, 0.0f);
  for (int64_t n = 0; n <= 37; ++n) { // every tail length of 8 and of 16
    std::vector<float> x(n);
    for (auto& value : x) {
      value = uniform(rng);
    }
    if (n > 3) {
      x[1] = -std::numeric_limits<float>::infinity();
      x[2] = 0.0f;
    }
    auto fast = x;
    auto portable = x;
    const float fast_sum = vectorised(fast.data(), n, -0.5f);
    const float portable_sum = attn::detail::exp_shifted_sum_portable(portable.data(), n, -0.5f);
    for (int64_t j = 0; j < n; ++j) {
      const double exact = std::exp(static_cast<double>(x[j]) + 0.5);
      // 4 float ulps relative; values below float's normal range may flush.
      EXPECT_NEAR(fast[j], exact, 4 * 1.2e-7 * exact + 1e-37) << "x=" << x[j] << " n=" << n;
      EXPECT_NEAR(portable[j], exact, 2 * 1.2e-7 * exact + 1e-37) << "x=" << x[j];
    }
    EXPECT_NEAR(fast_sum, portable_sum, 1e-6 * std::max(1.0f, portable_sum)) << "n=" << n;
  }
}

// The vector loops of `set` (isa.h), or a skip saying why there are none.
#define ATTN_VECTOR_LOOPS_OR_SKIP(loops, set)                                               \
  const auto* loops = attn::detail::isa_loops(set);                                         \
  if (loops == nullptr || loops->exp_shifted_sum == nullptr) {                              \
    GTEST_SKIP() << "this CPU or build runs no " << attn::detail::instruction_set_name(set) \
                 << " vector loops; the portable row operations run here";                  \
  }

TEST(RowOps, Avx2ExpMatchesLibmToAFewUlp) {
  ATTN_VECTOR_LOOPS_OR_SKIP(loops, attn::detail::InstructionSet::avx2);
  expect_exp_matches_libm(loops->exp_shifted_sum);
}

TEST(RowOps, Avx512ExpMatchesLibmToAFewUlp) {
  ATTN_VECTOR_LOOPS_OR_SKIP(loops, attn::detail::InstructionSet::avx512);
  expect_exp_matches_libm(loops->exp_shifted_sum);
}

// One row maximum against std::max_element at every tail length, the
// largest value in every lane, and rows of -inf.
void expect_row_max_finds_the_largest(attn::detail::RowMaxFn row_max) {
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> uniform(-50.0f, 50.0f);
  EXPECT_EQ(row_max(nullptr, 0), -kInf);
  for (int64_t n = 1; n <= 37; ++n) {
    for (int64_t where = 0; where < n; ++where) {
      std::vector<float> x(n);
      for (auto& value : x) {
        value = uniform(rng);
      }
      x[where] = 60.0f;
      EXPECT_EQ(row_max(x.data(), n), *std::max_element(x.begin(), x.end()))
          << "n=" << n << " at " << where;
    }
    const std::vector<float> masked(n, -std::numeric_limits<float>::infinity());
    EXPECT_EQ(row_max(masked.data(), n), -kInf) << "n=" << n;
  }
}

TEST(RowOps, Avx2RowMaxFindsTheLargestAtEveryTailLength) {
  ATTN_VECTOR_LOOPS_OR_SKIP(loops, attn::detail::InstructionSet::avx2);
  expect_row_max_finds_the_largest(loops->row_max);
}

TEST(RowOps, Avx512RowMaxFindsTheLargestAtEveryTailLength) {
  ATTN_VECTOR_LOOPS_OR_SKIP(loops, attn::detail::InstructionSet::avx512);
  expect_row_max_finds_the_largest(loops->row_max);
}

TEST(RowOps, DispatchedRowMaxFindsTheLargestAtEveryTailLength) {
  for (const auto level : attn::detail::cpu_levels()) {
    SCOPED_TRACE(attn::detail::cpu_level_name(level));
    static attn::detail::CpuLoops loops; // a function pointer captures nothing
    loops = attn::detail::cpu_loops(level);
    expect_row_max_finds_the_largest(
        [](const float* x, int64_t n) { return attn::detail::row_max(loops, x, n); });
  }
}

TEST(Workspace, ReusesEachThreadsBufferPerSlot) {
  using attn::detail::workspace_tensor;
  using attn::detail::WorkspaceSlot;
  const auto options = torch::TensorOptions(torch::kFloat);
  const auto first = workspace_tensor(WorkspaceSlot::tile_scores, {4, 8}, options);
  EXPECT_EQ(first.sizes(), torch::IntArrayRef({4, 8}));
  EXPECT_TRUE(first.is_contiguous());
  // The same slot again: the same memory, shaped as asked.
  const auto again = workspace_tensor(WorkspaceSlot::tile_scores, {2, 3}, options);
  EXPECT_EQ(again.data_ptr(), first.data_ptr());
  EXPECT_EQ(again.sizes(), torch::IntArrayRef({2, 3}));
  // Another slot: other memory, alive at the same time.
  const auto other = workspace_tensor(WorkspaceSlot::tile_grad_scores, {4, 8}, options);
  EXPECT_NE(other.data_ptr(), first.data_ptr());
  // Larger than the buffer: it grows; another dtype: a buffer of that dtype.
  const auto larger = workspace_tensor(WorkspaceSlot::tile_scores, {512, 512}, options);
  EXPECT_EQ(larger.numel(), 512 * 512);
  const auto doubles = workspace_tensor(
      WorkspaceSlot::tile_scores, {512, 512}, torch::TensorOptions(torch::kDouble));
  EXPECT_EQ(doubles.scalar_type(), torch::kDouble);
  doubles.fill_(1.0); // writable through its whole size
  EXPECT_EQ(doubles.sum().item<double>(), 512.0 * 512.0);
  // Beyond the cap: fresh memory each time.
  const int64_t beyond = static_cast<int64_t>(attn::detail::kMaxWorkspaceBytes / sizeof(float)) + 1;
  const auto big = workspace_tensor(WorkspaceSlot::keys_transposed, {beyond}, options);
  const auto big_again = workspace_tensor(WorkspaceSlot::keys_transposed, {beyond}, options);
  EXPECT_NE(big.data_ptr(), big_again.data_ptr());
  // Another thread: a buffer of its own.
  const void* mine = workspace_tensor(WorkspaceSlot::tile_scores, {4, 8}, options).data_ptr();
  const void* theirs = nullptr;
  std::thread([&] {
    theirs = workspace_tensor(WorkspaceSlot::tile_scores, {4, 8}, options).data_ptr();
  }).join();
  EXPECT_NE(theirs, mine);
}

// A thread whose first kernel call runs in InferenceMode (a decoding loop)
// and whose next runs outside it (training) writes the same reused buffers
// both times: they must be normal tensors.
TEST(Workspace, ServesCallsInAndOutOfInferenceModeOnOneThread) {
  torch::manual_seed(3);
  const auto make = [] { return torch::randn({1, 2, 40, 16}); };
  const auto q = make(), k = make(), v = make();
  const auto tiled = attn::SDPAOptions().need_weights(false).backend(
      attn::AttentionBackend::fused_cpu);
  const auto math = attn::SDPAOptions().need_weights(false).backend(attn::AttentionBackend::math);
  const auto expected = std::get<0>(attn::scaled_dot_product_attention(q, k, v, math));
  std::thread([&] { // a thread that has run no kernel yet
    try {
      {
        const c10::InferenceMode inference;
        EXPECT_CLOSE(
            std::get<0>(attn::scaled_dot_product_attention(q, k, v, tiled)), expected,
            attn::testing::kFloat32Tolerance);
      }
      const auto q_grad = q.clone().requires_grad_();
      const auto out = std::get<0>(attn::scaled_dot_product_attention(q_grad, k, v, tiled));
      EXPECT_CLOSE(out, expected, attn::testing::kFloat32Tolerance);
      out.sum().backward();
      EXPECT_TRUE(q_grad.grad().defined());
    } catch (const c10::Error& error) {
      ADD_FAILURE() << error.what_without_backtrace();
    }
  })
      .join();
}

// The loops of each CPU level this CPU runs up to AVX-512 (attn's float
// loops for each instruction set, and the BLAS's products), for `body(loops)`.
template <typename Body>
void for_each_float_level(const Body& body) {
  for (const auto level : attn::detail::cpu_levels()) {
    if (level > attn::detail::CpuLevel::avx512) {
      break; // the same float loops as AVX-512's
    }
    SCOPED_TRACE(std::string("level ") + attn::detail::cpu_level_name(level));
    body(attn::detail::cpu_loops(level));
  }
}

// The CPU's own word (GCC's and Clang's builtins) against the float loops
// of each level: every instruction set it has, the BLAS's products at
// portable.
TEST(TileProduct, EveryInstructionSetOfThisCpuRunsAttnsLoops) {
  using attn::detail::CpuLevel;
  const auto& levels = attn::detail::cpu_levels();
  ASSERT_FALSE(levels.empty());
  EXPECT_EQ(levels.front(), CpuLevel::portable);
  const auto portable = attn::detail::cpu_loops(CpuLevel::portable);
  EXPECT_FALSE(attn::detail::tile_products_run(portable, torch::kFloat));
  EXPECT_FALSE(attn::detail::tile_products_run(attn::testing::widest_loops(), torch::kDouble));
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const auto has = [&](CpuLevel each) {
    return std::find(levels.begin(), levels.end(), each) != levels.end();
  };
  if (std::getenv("ATTN_CPU_CAPABILITY") == nullptr) {
    EXPECT_EQ(has(CpuLevel::avx2), avx2);
    EXPECT_EQ(has(CpuLevel::avx512), avx512);
  }
  for (const auto level : {CpuLevel::avx2, CpuLevel::avx512}) {
    if (has(level)) {
      EXPECT_TRUE(attn::detail::tile_products_run(attn::detail::cpu_loops(level), torch::kFloat))
          << attn::detail::cpu_level_name(level);
    }
  }
#else
  EXPECT_EQ(levels.size(), 1U);
  GTEST_SKIP() << "attn's loops are built for x86 with GCC or Clang only; the BLAS multiplies here";
#endif
}

TEST(TileProduct, MatchesAFloat64ProductAtEveryTileEdge) {
  torch::manual_seed(7);
  ThreadCount one_thread(1); // attn's loops run every product on one thread
  for_each_float_level([](const attn::detail::CpuLoops& loops) {
    // Rows around the micro-tiles' 4 and 8, columns around their 16 and 32
    // (registers of 8 and 16 floats), depths from none to a key block's; a
    // read plain and transposed, c overwritten and accumulated into, as the
    // kernels call it.
    for (const int64_t rows : {1, 3, 4, 5, 8, 9, 17, 128}) {
      for (const int64_t cols : {1, 7, 8, 9, 15, 16, 17, 32, 33, 70}) {
        for (const int64_t depth : {0, 1, 5, 64}) {
          for (const bool a_transposed : {false, true}) {
            for (const double beta : {0.0, 1.0}) {
              SCOPED_TRACE(
                  "rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) + " depth=" +
                  std::to_string(depth) + " a_transposed=" + std::to_string(a_transposed) +
                  " beta=" + std::to_string(beta));
              const auto a = a_transposed ? torch::randn({depth, rows}).t()
                                          : torch::randn({rows, depth});
              const auto b = torch::randn({depth + 2, cols}).narrow(0, 1, depth); // ld = cols
              // c inside a wider buffer, so that a write past its columns shows.
              const auto buffer = torch::randn({rows, cols + 3});
              const auto c = buffer.narrow(1, 0, cols);
              const auto before = buffer.clone();
              const double alpha = 0.125;
              attn::detail::tile_addmm(loops, c, a, b, beta, alpha);
              const auto expected = before.narrow(1, 0, cols).to(torch::kDouble) * beta +
                  alpha * torch::mm(a.to(torch::kDouble), b.to(torch::kDouble));
              EXPECT_CLOSE(c, expected, (Tolerance{1e-5, 1e-5}));
              EXPECT_TRUE(torch::equal(buffer.narrow(1, cols, 3), before.narrow(1, cols, 3)));
            }
          }
        }
      }
    }
  });
}

// Rows widened from float16 and rounded to it as c10::Half converts, bit
// for bit, at every tail length of the registers: finite values, ±0,
// infinities, NaN, float16's subnormals, ties, and floats beyond its range;
// on each instruction set's loops (AVX2's with F16C), and one by one while
// the BLAS multiplies.
TEST(TileProduct, Float16RowsConvertAsC10Half) {
  torch::manual_seed(19);
  const bool f16c = attn::testing::linux_cpu_flags().count("f16c") > 0;
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {0.0F,     -0.0F,    inf,     -inf,     std::nanf(""),   65504.0F,
                            65520.0F, 70000.0F, 6.0e-8F, -3.0e-5F, 1.0F + 0x1p-11F, 1.0F + 0x3p-11F,
                            1e-9F,    0x1p-24F};
  for_each_float_level([&](const attn::detail::CpuLoops& loops) {
    using attn::detail::CpuLevel;
    EXPECT_EQ(
        attn::detail::half_products_run(loops),
        loops.level == CpuLevel::avx512 || (loops.level == CpuLevel::avx2 && f16c));
    for (const int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 33}) {
      SCOPED_TRACE("n=" + std::to_string(n));
      // Random values of float16's range at odd places, the specials at even ones.
      auto floats = torch::randn({n}) * 100;
      for (int64_t j = 0; j < n; j += 2) {
        floats[j] = specials[j / 2 % static_cast<int64_t>(std::size(specials))];
      }
      std::vector<uint16_t> rounded(static_cast<size_t>(n) + 1, 0xABCD);
      attn::detail::round_half_row(loops, floats.data_ptr<float>(), n, rounded.data());
      std::vector<float> widened(static_cast<size_t>(n) + 1, 42.0F);
      attn::detail::widen_half_row(loops, rounded.data(), n, widened.data());
      for (int64_t j = 0; j < n; ++j) {
        const auto expected = c10::Half(floats[j].item<float>());
        const auto at = static_cast<size_t>(j);
        EXPECT_EQ(rounded[at], expected.x) << "rounding " << floats[j].item<float>();
        const float back = static_cast<float>(expected);
        EXPECT_TRUE(widened[at] == back || (std::isnan(widened[at]) && std::isnan(back)))
            << "widening " << back << " gave " << widened[at];
      }
      EXPECT_EQ(rounded.back(), 0xABCD) << "a write past the row";
      EXPECT_EQ(widened.back(), 42.0F) << "a write past the row";
    }
  });
}

// bfloat16 rows (tile_product.h, half_rows) widened and rounded as
// c10::BFloat16 converts, bit for bit, at every tail length of the
// registers: finite values, ±0, infinities, NaN, ties, floats beyond its
// range; subnormals round to c10's value or, on AVX512-BF16, to zero.
// Widened on each instruction set's loops, and one by one at level
// portable; rounded on AVX512-BF16 where the level has it, else one by
// one.
TEST(TileProduct, Bfloat16RowsConvertAsC10BFloat16) {
  torch::manual_seed(23);
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {0.0F,           -0.0F,   inf,       -inf,
                            std::nanf(""),  3.0e38F, 3.4e38F,   1.0F + 0x1p-8F,
                            1.0F + 0x3p-8F, -1e-39F, 0x1p-130F, 1.0F + 0x1p-9F};
  for (const auto level : attn::detail::cpu_levels()) {
    SCOPED_TRACE(std::string("level ") + attn::detail::cpu_level_name(level));
    const auto rows = attn::detail::half_rows(attn::detail::cpu_loops(level), torch::kBFloat16);
    for (const int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 33}) {
      SCOPED_TRACE("n=" + std::to_string(n));
      // Random values at odd places, the specials at even ones.
      auto floats = torch::randn({n}) * 100;
      for (int64_t j = 0; j < n; j += 2) {
        floats[j] = specials[j / 2 % static_cast<int64_t>(std::size(specials))];
      }
      std::vector<uint16_t> rounded(static_cast<size_t>(n) + 1, 0xABCD);
      rows.round(floats.data_ptr<float>(), n, rounded.data());
      std::vector<float> widened(static_cast<size_t>(n) + 1, 42.0F);
      rows.widen(rounded.data(), n, widened.data());
      for (int64_t j = 0; j < n; ++j) {
        const float value = floats[j].item<float>();
        const auto expected = c10::BFloat16(value);
        const auto at = static_cast<size_t>(j);
        const bool nan = std::isnan(value);
        const bool flushed = std::fpclassify(value) == FP_SUBNORMAL && (rounded[at] & 0x7FFFU) == 0;
        EXPECT_TRUE(
            rounded[at] == expected.x || flushed || (nan && (rounded[at] & 0x7FFFU) > 0x7F80U))
            << "rounding " << value;
        const float back = c10::BFloat16(rounded[at], c10::BFloat16::from_bits());
        EXPECT_TRUE(widened[at] == back || (std::isnan(widened[at]) && std::isnan(back)))
            << "widening " << back << " gave " << widened[at];
        if (!std::isnan(back)) {
          EXPECT_EQ(std::signbit(widened[at]), std::signbit(back)) << "widening " << back;
        }
      }
      EXPECT_EQ(rounded.back(), 0xABCD) << "a write past the row";
      EXPECT_EQ(widened.back(), 42.0F) << "a write past the row";
    }
  }
}

// attn's bfloat16 products, accumulated in float (AVX512-BF16's vdpbf16ps
// micro-tiles, AMX tiles), against the float64 product of the same
// bfloat16 values: around every edge of the micro-tiles (8 × 32) and of
// AMX's blocks (32 × 32 × 32 of the depth, copied zero-padded where not
// whole), at odd depths (whose last depth the micro-tiles multiply alone),
// with b packed in pairs from rows or from columns as the kernels hold keys
// and values; the packing against its definition.
// B (depth, cols) in bfloat16 as pack_bf16_pairs writes it, into rows ld
// apart of a buffer filled with 7 first.
torch::Tensor packed_pairs(const torch::Tensor& b, int64_t ld) {
  const int64_t depth = b.size(0), cols = b.size(1);
  const auto packed = torch::full({(depth + 1) / 2, ld}, 7.0, torch::kBFloat16);
  attn::detail::pack_bf16_pairs(
      attn::testing::widest_loops(), depth, cols, b.data_ptr<c10::BFloat16>(), b.stride(0),
      b.stride(1), packed.data_ptr<c10::BFloat16>(), ld);
  return packed;
}

// What packed_pairs must hold, in float64: B's rows i and i + 1 alternating
// in row i / 2, zeros after an odd depth's last row, the 7s past 2·cols.
torch::Tensor expected_pairs(const torch::Tensor& b, int64_t ld) {
  const int64_t depth = b.size(0), cols = b.size(1);
  auto expected = torch::full({(depth + 1) / 2, ld}, 7.0, torch::kDouble);
  expected.narrow(1, 0, 2 * cols).zero_();
  for (int64_t i = 0; i < depth; ++i) {
    expected[i / 2]
        .narrow(0, i % 2, 2 * cols - i % 2)
        .slice(0, 0, c10::nullopt, 2)
        .copy_(b[i].to(torch::kDouble));
  }
  return expected;
}

// The packing runs on every CPU (the products only where the CPU has
// them): B row-major, transposed (pairs adjacent in memory, packed as
// words), transposed with an even stride past an odd depth, and starting
// at an odd element (not word-aligned).
TEST(TileProduct, Bfloat16PairsPackEveryLayout) {
  torch::manual_seed(13);
  for (const int64_t cols : {1, 15, 16, 17, 70}) {
    for (const int64_t depth : {1, 2, 5, 64, 65}) {
      const auto bf16 = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
      const torch::Tensor layouts[] = {
          bf16(torch::randn({depth, cols})), bf16(torch::randn({cols, depth})).t(),
          bf16(torch::randn({cols, depth + depth % 2})).t().narrow(0, 0, depth),
          bf16(torch::randn({cols, depth + 2})).t().narrow(0, 1, depth)};
      for (size_t l = 0; l < std::size(layouts); ++l) {
        SCOPED_TRACE(
            "cols=" + std::to_string(cols) + " depth=" + std::to_string(depth) +
            " layout=" + std::to_string(l));
        for (const int64_t ld : {2 * cols, 2 * cols + 6, 2 * cols + 7}) {
          EXPECT_TRUE(torch::equal(
              packed_pairs(layouts[l], ld).to(torch::kDouble), expected_pairs(layouts[l], ld)));
        }
      }
    }
  }
}

TEST(TileProduct, Bfloat16ProductsMatchAFloat64ProductOfTheirInputs) {
  using attn::detail::Bf16GemmOperands;
  using attn::detail::CpuLevel;
  const auto flags = attn::testing::linux_cpu_flags();
  const auto& levels = attn::detail::cpu_levels();
  const auto has = [&](CpuLevel level) {
    return std::find(levels.begin(), levels.end(), level) != levels.end();
  };
  if (std::getenv("ATTN_CPU_CAPABILITY") == nullptr) {
    EXPECT_EQ(has(CpuLevel::avx512_bf16), flags.count("avx512_bf16") > 0);
  }
  // The loops multiply bfloat16 in bfloat16 on AMX, or on AMD's AVX512-BF16.
  const bool amd = attn::testing::linux_cpuinfo_field("vendor_id") == "AuthenticAMD";
  if (std::getenv("ATTN_CPU_CAPABILITY") == nullptr) {
    EXPECT_EQ(
        attn::detail::bf16_products_outrun_float(attn::testing::widest_loops()),
        attn::detail::amx_products_run() || (amd && flags.count("avx512_bf16") > 0));
  }
  std::vector<std::pair<std::string, attn::detail::CpuLoops>> products;
  if (has(CpuLevel::avx512_bf16)) {
    products.emplace_back("AVX512-BF16", attn::detail::cpu_loops(CpuLevel::avx512_bf16));
  }
  if (has(CpuLevel::amx) && attn::detail::amx_products_run()) {
    products.emplace_back("AMX", attn::detail::cpu_loops(CpuLevel::amx));
  } else if (flags.count("amx_bf16") > 0 && !attn::detail::amx_tiles_granted()) {
    ADD_FAILURE() << "/proc/cpuinfo lists amx_bf16, but Linux did not grant the tile state";
  }
  if (products.empty()) {
    GTEST_SKIP() << "neither AVX512-BF16 nor AMX here: attn's bfloat16 products do not run";
  }
  torch::manual_seed(11);
  const auto bf16 = torch::kBFloat16;
  for (const int64_t rows : {1, 3, 8, 9, 17, 32, 33}) {
    for (const int64_t cols : {1, 15, 16, 17, 32, 33, 64, 70}) {
      for (const int64_t depth : {1, 2, 5, 64, 65}) {
        // B row-major, B transposed (pairs adjacent in memory: K read as
        // Kᵀ), and B transposed with an even stride past an odd depth.
        for (const int b_layout : {0, 1, 2}) {
          SCOPED_TRACE(
              "rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) +
              " depth=" + std::to_string(depth) + " b_layout=" + std::to_string(b_layout));
          const auto a = torch::randn({rows, depth + 3}).to(bf16).narrow(1, 0, depth);
          const auto b = b_layout == 0 ? torch::randn({depth, cols}).to(bf16)
              : b_layout == 1
              ? torch::randn({cols, depth}).to(bf16).t()
              : torch::randn({cols, depth + depth % 2}).to(bf16).t().narrow(0, 0, depth);
          const int64_t ld = 2 * cols + 6;
          const auto packed = packed_pairs(b, ld);
          ASSERT_TRUE(torch::equal(packed.to(torch::kDouble), expected_pairs(b, ld)));
          const auto a64 = a.to(torch::kDouble), b64 = b.to(torch::kDouble);
          // Float accumulation: a few units of float's rounding per term.
          const auto bound = 4e-7 * (depth + 1) * a64.abs().mm(b64.abs()) + 1e-6;
          for (const auto& [name, loops] : products) {
            for (const bool accumulate : {false, true}) {
              SCOPED_TRACE(name + " accumulate=" + std::to_string(accumulate));
              const auto buffer = torch::randn({rows, cols + 3});
              const auto c = buffer.narrow(1, 0, cols);
              const auto before = buffer.clone();
              const float alpha = 0.125F;
              ASSERT_TRUE(attn::detail::gemm_bf16(
                  loops, rows, cols,
                  Bf16GemmOperands{
                      depth, alpha, reinterpret_cast<const uint16_t*>(a.data_ptr<c10::BFloat16>()),
                      a.stride(0),
                      reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()), ld,
                      c.data_ptr<float>(), c.stride(0), accumulate}));
              const auto expected = before.narrow(1, 0, cols).to(torch::kDouble) *
                      (accumulate ? 1 : 0) +
                  alpha * a64.mm(b64);
              const auto error = (c.to(torch::kDouble) - expected).abs();
              EXPECT_TRUE((error <= bound).all().item<bool>())
                  << "largest error " << error.max().item<double>();
              EXPECT_TRUE(torch::equal(buffer.narrow(1, cols, 3), before.narrow(1, cols, 3)));
            }
          }
        }
      }
    }
  }
}

// One banded product against the float64 product, row block by row block:
// inside its band the product (restricted to the band's depth), outside it
// the values from before.
void expect_banded_product(
    const attn::detail::CpuLoops& loops,
    attn::detail::ProductBand band,
    const std::vector<attn::detail::IndexRange>& bands,
    double beta) {
  using attn::detail::kProductRowBlock;
  const int64_t rows = 20, cols = 70, depth = 40; // row blocks of 8, 8 and 4
  const auto a = torch::randn({rows, depth});
  const auto b = torch::randn({depth, cols});
  const auto c = torch::randn({rows, cols});
  const auto before = c.to(torch::kDouble);
  const double alpha = 0.5;
  using attn::detail::matrix_of;
  attn::detail::tile_addmm_banded(
      loops, matrix_of<float>(c), matrix_of<float>(a), matrix_of<float>(b), beta, alpha, band,
      bands);
  for (size_t block = 0; block < bands.size(); ++block) {
    SCOPED_TRACE("row block " + std::to_string(block));
    const int64_t r0 = static_cast<int64_t>(block) * kProductRowBlock;
    const int64_t n = std::min(kProductRowBlock, rows - r0);
    const auto [begin, end] = bands[block];
    auto expected = before.narrow(0, r0, n).clone();
    const auto a_rows = a.narrow(0, r0, n).to(torch::kDouble);
    const auto b_all = b.to(torch::kDouble);
    if (band == attn::detail::ProductBand::columns) {
      expected.narrow(1, begin, end - begin)
          .mul_(beta)
          .add_(alpha * a_rows.mm(b_all.narrow(1, begin, end - begin)));
    } else {
      expected.mul_(beta).add_(
          alpha * a_rows.narrow(1, begin, end - begin).mm(b_all.narrow(0, begin, end - begin)));
    }
    EXPECT_CLOSE(c.narrow(0, r0, n), expected, (Tolerance{1e-5, 1e-5}));
  }
}

TEST(TileProduct, BandedProductsComputeTheirBandsOnly) {
  torch::manual_seed(8);
  ThreadCount one_thread(1);
  using attn::detail::ProductBand;
  const std::vector<attn::detail::IndexRange> columns{{0, 32}, {32, 70}, {0, 0}};
  const std::vector<attn::detail::IndexRange> depths{{0, 40}, {8, 24}, {0, 0}};
  for_each_float_level([&](const attn::detail::CpuLoops& loops) {
    for (const double beta : {0.0, 1.0}) {
      expect_banded_product(loops, ProductBand::columns, columns, beta);
      expect_banded_product(loops, ProductBand::depth, depths, beta);
    }
  });
}

// The spread row stride holds a row, and is an odd number of 64-byte
// lines, so that rows a power of two apart in size still fall in different
// cache sets.
TEST(TileProduct, SpreadRowStridesAreAnOddNumberOfCacheLines) {
  using attn::detail::spread_row_stride;
  EXPECT_EQ(spread_row_stride(512, 4), 528);
  EXPECT_EQ(spread_row_stride(4096, 4), 4112);
  EXPECT_EQ(spread_row_stride(48, 4), 48);
  EXPECT_EQ(spread_row_stride(1, 4), 16);
  EXPECT_EQ(spread_row_stride(64, 8), 72);
  for (const int64_t element_size : {4, 8}) {
    const int64_t per_line = 64 / element_size;
    for (int64_t cols = 1; cols <= 300; ++cols) {
      const int64_t stride = spread_row_stride(cols, element_size);
      EXPECT_GE(stride, cols);
      EXPECT_LT(stride, cols + 2 * per_line);
      EXPECT_EQ(stride % per_line, 0) << cols;
      EXPECT_EQ(stride / per_line % 2, 1) << cols;
    }
  }
}

// transpose_float against ATen's transpose, at sizes around its 8 × 8 and 16 × 16
// register blocks, from rows of unit and of wider column strides, into
// rows wider than the result (so that a write past a row's end shows).
TEST(TileProduct, TransposesMatchATensTranspose) {
  torch::manual_seed(9);
  for_each_float_level([](const attn::detail::CpuLoops& loops) {
    for (const int64_t rows : {0, 1, 7, 8, 9, 15, 16, 17, 48, 130}) {
      for (const int64_t cols : {1, 8, 16, 33, 64}) {
        for (const int64_t column_stride : {1, 2}) {
          SCOPED_TRACE(
              "rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) +
              " column_stride=" + std::to_string(column_stride));
          const auto from = torch::randn({rows, cols * column_stride + 3})
                                .narrow(1, 0, cols * column_stride)
                                .slice(1, 0, cols * column_stride, column_stride);
          const auto to = torch::full({cols, rows + 5}, -1.0F);
          attn::detail::transpose_float(
              loops, rows, cols, from.data_ptr<float>(), from.stride(0), from.stride(1),
              to.data_ptr<float>(), to.stride(0));
          EXPECT_TRUE(torch::equal(to.narrow(1, 0, rows), from.t()));
          EXPECT_TRUE(torch::equal(to.narrow(1, rows, 5), torch::full({cols, 5}, -1.0F)));
        }
      }
    }
  });
}

enum class MaskKind { none, bool_pairs, bool_padding, float_per_head };

struct KernelCase {
  int64_t B, H, Hkv, L, S, D, Dv;
  MaskKind mask;
  bool causal;
  int64_t query_offset;
  int64_t window; // 0: none
  bool empty_row; // one query row with every key masked
  torch::ScalarType dtype;
  int threads;

  std::string describe() const {
    std::ostringstream s;
    s << "B=" << B << " H=" << H << " Hkv=" << Hkv << " L=" << L << " S=" << S << " D=" << D
      << " Dv=" << Dv << " mask=" << static_cast<int>(mask) << " causal=" << causal
      << " query_offset=" << query_offset << " window=" << window << " empty_row=" << empty_row
      << " dtype=" << dtype << " threads=" << threads;
    return s.str();
  }
};

// One of a list of values, uniformly, from a seeded engine: the same
// sequence of picks on every run.
class SeededPick {
 public:
  explicit SeededPick(unsigned seed) : rng_(seed) {}
  int64_t operator()(std::initializer_list<int64_t> values) {
    std::vector<int64_t> v(values);
    return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng_)];
  }

 private:
  std::mt19937 rng_;
};

// Seeded random configurations, biased towards the tile edges (128 query
// rows, 512 keys) and lengths that are not multiples of them, with grouped
// key/value heads, causal offsets and sliding windows.
std::vector<KernelCase> random_cases(int count) {
  SeededPick pick(2024);
  std::vector<KernelCase> cases;
  for (int i = 0; i < count; ++i) {
    KernelCase c;
    c.B = pick({1, 2});
    c.H = pick({1, 3, 4});
    c.Hkv = c.H == 4 ? pick({4, 2, 1}) : pick({c.H, 1});
    c.L = pick({1, 5, 63, 64, 65, 130});
    c.S = pick({1, 7, 64, 511, 512, 513, 700});
    c.D = pick({4, 16, 64});
    c.Dv = pick({c.D, 8});
    c.mask = static_cast<MaskKind>(pick({0, 1, 2, 3}));
    c.causal = pick({0, 1}) == 1;
    // Top-left, bottom-right (a KV cache's), before the keys and far along.
    c.query_offset = pick({0, 0, c.S - c.L, -3, 40});
    c.window = pick({0, 0, 1, 17, 300, 600});
    c.empty_row = c.mask != MaskKind::none && pick({0, 1}) == 1;
    c.dtype = pick({0, 1}) == 1 ? torch::kDouble : torch::kFloat;
    c.threads = static_cast<int>(pick({1, 2}));
    cases.push_back(c);
  }
  return cases;
}

torch::Tensor make_mask(const KernelCase& c) {
  const auto opts = torch::TensorOptions(c.dtype);
  torch::Tensor mask;
  switch (c.mask) {
    case MaskKind::none: return {};
    case MaskKind::bool_pairs:
      mask = (torch::rand({c.L, c.S}) > 0.3).expand({c.B, c.H, c.L, c.S});
      break;
    case MaskKind::bool_padding:
      mask = (torch::rand({c.B, 1, 1, c.S}) > 0.2).expand({c.B, c.H, c.L, c.S});
      break;
    case MaskKind::float_per_head:
      mask = torch::randn({c.B, c.H, c.L, c.S}, opts)
                 .masked_fill(torch::rand({c.B, c.H, c.L, c.S}) > 0.8, -kInf);
      break;
  }
  if (c.empty_row) {
    mask = mask.clone();
    mask.select(2, c.L / 2).fill_(mask.scalar_type() == torch::kBool ? 0.0 : -kInf);
  }
  return mask;
}

// A case's inputs, the kernels' parameters and the math path's results on
// them.
struct KernelRun {
  torch::Tensor q, k, v;
  attn::detail::AttentionParams params;
  torch::Tensor math_out, math_weights;
  Tolerance tolerance, gradient_tolerance;

  // `values_of`: the dtype whose values the inputs take (held in c.dtype),
  // for half-precision runs checked against float64 on the same values.
  explicit KernelRun(const KernelCase& c, c10::optional<torch::ScalarType> values_of = {}) {
    torch::manual_seed(static_cast<uint64_t>(c.L * 1000 + c.S));
    const auto opts = torch::TensorOptions(c.dtype);
    const auto input = [&](int64_t heads, int64_t T, int64_t F) {
      const auto drawn = torch::randn({c.B, heads, T, F}, opts);
      return (values_of ? drawn.to(*values_of).to(c.dtype) : drawn).requires_grad_();
    };
    q = input(c.H, c.L, c.D);
    k = input(c.Hkv, c.S, c.D);
    v = input(c.Hkv, c.S, c.Dv);
    const auto mask = make_mask(c);
    const double scale = 1.0 / std::sqrt(c.D);
    params = kernel_params(q, k, v, scale, c.causal);
    params.mask = mask;
    params.query_offset = c.query_offset;
    params.window = c.window;
    std::tie(math_out, math_weights) = attn::detail::math_attention(params);
    // float32: O(1) values after sums of up to 700 terms in another order.
    // Gradients sum once more, relative to their largest entry (at least 1).
    const bool single = c.dtype == torch::kFloat;
    tolerance = Tolerance{single ? 2e-5 : 1e-12};
    const double gradient_error = single ? 5e-5 : 1e-11;
    gradient_tolerance = Tolerance{gradient_error, gradient_error};
  }

  // The gradients of q, k and v for `upstream` flowing into `outputs`,
  // checked against the math path's for the same upstream into `reference`.
  void expect_same_gradients(
      const std::vector<torch::Tensor>& outputs,
      const std::vector<torch::Tensor>& reference,
      const std::vector<torch::Tensor>& upstream) const {
    // The graphs are kept: a test may ask through several of their outputs.
    const auto grads = torch::autograd::grad(outputs, {q, k, v}, upstream, /*retain_graph=*/true);
    const auto math_grads = torch::autograd::grad(
        reference, {q, k, v}, upstream, /*retain_graph=*/true);
    const char* names[] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; ++i) {
      EXPECT_CLOSE(grads[i], math_grads[i], gradient_tolerance) << names[i];
      EXPECT_TRUE(torch::isfinite(grads[i]).all().item<bool>()) << names[i];
    }
  }
};

class CpuKernels : public ::testing::TestWithParam<KernelCase> {};

TEST_P(CpuKernels, TiledKernelsMatchTheMathPathInOutputWeightsAndGradients) {
  const auto& c = GetParam();
  SCOPED_TRACE(c.describe());
  ThreadCount threads(c.threads);
  const KernelRun run(c);
  const auto out = attn::detail::fused_attention(
      attn::testing::kernel_plan(FusedLoops::tiled), run.params);
  attn::detail::ForwardResult with_weights;
  {
    torch::NoGradGuard no_grad;
    with_weights = attn::detail::tiled_forward_with_weights(
        attn::testing::widest_loops(), run.params);
  }
  EXPECT_CLOSE(out, run.math_out, run.tolerance);
  EXPECT_CLOSE(with_weights.out, run.math_out, run.tolerance);
  EXPECT_CLOSE(with_weights.weights, run.math_weights, run.tolerance);
  run.expect_same_gradients({out}, {run.math_out}, {torch::randn(out.sizes(), out.options())});
}

TEST_P(CpuKernels, BatchedKernelMatchesTheMathPathInOutputWeightsAndGradients) {
  const auto& c = GetParam();
  SCOPED_TRACE(c.describe());
  ThreadCount threads(c.threads);
  const KernelRun run(c);
  const auto plan = attn::testing::kernel_plan(FusedLoops::tiled);
  const auto [out, weights] = attn::detail::batched_attention(
      plan, run.params, /*need_weights=*/true);
  EXPECT_CLOSE(out, run.math_out, run.tolerance);
  EXPECT_CLOSE(weights, run.math_weights, run.tolerance);
  // Through the output alone, and through the output and the weights.
  const auto upstream = torch::randn(out.sizes(), out.options());
  run.expect_same_gradients({out}, {run.math_out}, {upstream});
  run.expect_same_gradients(
      {out, weights}, {run.math_out, run.math_weights},
      {upstream, torch::randn(weights.sizes(), weights.options())});
  const auto [alone, no_weights] = attn::detail::batched_attention(
      plan, run.params, /*need_weights=*/false);
  EXPECT_FALSE(no_weights.defined());
  EXPECT_TRUE(torch::equal(alone, out));
}

// Every kernel's forward has one shape: (out, lse, weights where the
// kernel keeps them). The row log-sum-exp against float64's logsumexp of
// the scaled scores plus the case's mask and band as an additive bias
// (-inf for a row that sees no key).
TEST_P(CpuKernels, EveryKernelsForwardReturnsTheRowLogSumExp) {
  const auto& c = GetParam();
  SCOPED_TRACE(c.describe());
  ThreadCount threads(c.threads);
  const KernelRun run(c);
  const torch::NoGradGuard no_grad;
  const auto q = run.q.to(torch::kDouble);
  const auto k = run.k.to(torch::kDouble).repeat_interleave(c.H / c.Hkv, 1);
  auto scores = q.matmul(k.transpose(-2, -1)) * run.params.scale +
      attn::testing::additive_bias(
                    attn::testing::band_mask(c.L, c.S, c.query_offset, c.causal, c.window));
  if (run.params.mask.defined()) {
    scores = scores + attn::testing::additive_bias(run.params.mask);
  }
  const auto expected = scores.logsumexp(-1);
  const auto unseen = torch::isinf(expected); // -inf - -inf is no difference to compare
  const std::pair<const char*, attn::detail::ForwardResult> results[] = {
      {"tiled",
       attn::detail::fused_forward(attn::testing::kernel_plan(FusedLoops::tiled), run.params)},
      {"tiled with weights",
       attn::detail::tiled_forward_with_weights(attn::testing::widest_loops(), run.params)},
      {"batched", attn::detail::batched_forward(attn::testing::widest_loops(), run.params)}};
  for (const auto& [kernel, result] : results) {
    const auto lse = result.lse.to(torch::kDouble);
    EXPECT_TRUE(torch::equal(lse == -kInf, unseen)) << kernel;
    EXPECT_CLOSE(lse.masked_fill(unseen, 0), expected.masked_fill(unseen, 0), run.tolerance)
        << kernel;
    EXPECT_EQ(result.weights.defined(), std::string(kernel) != "tiled") << kernel;
  }
}

INSTANTIATE_TEST_SUITE_P(RandomSweep, CpuKernels, ::testing::ValuesIn(random_cases(64)));

// Seeded float32 configurations for the fused kernel's short loops: query
// and key lengths around their 16-key vectors and row blocks up to the
// bounds of short_heads.h, feature widths around whole vectors, grouped
// heads, masks, causal offsets and windows.
std::vector<KernelCase> short_head_cases(int count) {
  SeededPick pick(77);
  std::vector<KernelCase> cases;
  for (int i = 0; i < count; ++i) {
    KernelCase c;
    c.B = pick({1, 2});
    c.H = pick({1, 4});
    c.Hkv = c.H == 4 ? pick({4, 2, 1}) : 1;
    c.L = pick({1, 3, 8, 9, 16, 17, 33, 127, 128});
    c.S = pick({1, 2, 15, 16, 17, 31, 33, 48, 63, 64});
    c.D = pick({1, 16, 20, 64});
    c.Dv = pick({c.D, 5, 80});
    c.mask = static_cast<MaskKind>(pick({0, 1, 2, 3}));
    c.causal = pick({0, 1}) == 1;
    c.query_offset = pick({0, 0, c.S - c.L, -3, 40});
    c.window = pick({0, 0, 1, 5, 30});
    c.empty_row = c.mask != MaskKind::none && pick({0, 1}) == 1;
    c.dtype = torch::kFloat;
    c.threads = static_cast<int>(pick({1, 2}));
    cases.push_back(c);
  }
  return cases;
}

TEST(ShortHeads, EveryInstructionSetMatchesTheMathPathInOutputAndGradients) {
  for_each_float_level([](const attn::detail::CpuLoops& loops) {
    const bool short_loops = loops.level != attn::detail::CpuLevel::portable;
    for (const auto& c : short_head_cases(48)) {
      SCOPED_TRACE(c.describe());
      // The route: the short loops wherever attn's loops multiply.
      EXPECT_EQ(attn::detail::short_heads_run(loops, c.dtype, c.L, c.S), short_loops);
      ThreadCount threads(c.threads);
      const KernelRun run(c);
      const auto out = attn::detail::fused_attention(
          {loops, short_loops ? FusedLoops::short_heads : FusedLoops::tiled}, run.params);
      EXPECT_CLOSE(out, run.math_out, run.tolerance);
      run.expect_same_gradients({out}, {run.math_out}, {torch::randn(out.sizes())});
      if (HasFailure()) {
        return; // one reproducible configuration is enough to report
      }
    }
  });
}

// bfloat16 and float16 on the short loops, which widen each head exactly
// into float copies and round each result once (short_heads.h): the
// short-head cases, grouped heads among them, against the float64 math
// path of the same rounded inputs. The output within float32's tolerance
// plus half an ulp of the half precision, relative to the largest; each
// gradient within float32's plus four such ulps (dQ and dK carry the
// stored output's rounding through delta_i = dO_i·O_i: test_support.h,
// float16_delta_error). Wrong heads, rows or groups miss by O(1).
TEST(ShortHeads, HalfPrecisionIsTheFloatComputationOfItsValuesRoundedOnce) {
  for_each_float_level([](const attn::detail::CpuLoops& loops) {
    if (loops.level == attn::detail::CpuLevel::portable) {
      return; // no short loops with the BLAS's products
    }
    for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
      const double half_ulp = std::ldexp(1.0, dtype == torch::kBFloat16 ? -8 : -11);
      auto cases = short_head_cases(16);
      // Eight heads of a million FLOPs each: one task per head on 2 threads.
      cases.push_back({2, 4, 2, 128, 64, 64, 64, MaskKind::none, true, 0, 0, false, {}, 2});
      for (auto c : cases) {
        c.dtype = torch::kDouble;
        SCOPED_TRACE(c.describe() + " computed in " + c10::toString(dtype));
        ASSERT_TRUE(attn::detail::short_heads_run(loops, dtype, c.L, c.S));
        ThreadCount threads(c.threads);
        const KernelRun reference(c, dtype);
        auto params = reference.params;
        const auto in_half = [&](const torch::Tensor& t) {
          return t.detach().to(dtype).requires_grad_();
        };
        params.q = in_half(reference.q);
        params.k = in_half(reference.k);
        params.v = in_half(reference.v);
        if (params.mask.defined() && params.mask.is_floating_point()) {
          params.mask = params.mask.to(torch::kFloat);
        }
        const auto out = attn::detail::fused_attention({loops, FusedLoops::short_heads}, params);
        ASSERT_EQ(out.scalar_type(), dtype);
        EXPECT_CLOSE(out, reference.math_out, (Tolerance{2e-5, half_ulp}));
        const auto upstream = torch::randn(out.sizes()).to(dtype);
        const auto grads = torch::autograd::grad({out}, {params.q, params.k, params.v}, {upstream});
        const auto math_grads = torch::autograd::grad(
            {reference.math_out}, {reference.q, reference.k, reference.v},
            {upstream.to(torch::kDouble)});
        const char* names[] = {"dq", "dk", "dv"};
        for (int i = 0; i < 3; ++i) {
          ASSERT_EQ(grads[i].scalar_type(), dtype) << names[i];
          EXPECT_CLOSE(grads[i], math_grads[i], (Tolerance{5e-5, 5e-5 + 4 * half_ulp})) << names[i];
        }
        if (HasFailure()) {
          return; // one reproducible configuration is enough to report
        }
      }
    }
  });
}

TEST(ShortHeads, TakeHeadsUpToTheirBoundsOnly) {
  using attn::detail::kMaxShortKeys;
  using attn::detail::kMaxShortQueries;
  using attn::detail::short_heads_run;
  for_each_float_level([](const attn::detail::CpuLoops& loops) {
    const bool short_loops = loops.level != attn::detail::CpuLevel::portable;
    EXPECT_EQ(short_heads_run(loops, torch::kFloat, kMaxShortQueries, kMaxShortKeys), short_loops);
    EXPECT_EQ(short_heads_run(loops, torch::kFloat, 0, 0), short_loops);
    EXPECT_FALSE(short_heads_run(loops, torch::kFloat, kMaxShortQueries + 1, kMaxShortKeys));
    EXPECT_FALSE(short_heads_run(loops, torch::kFloat, kMaxShortQueries, kMaxShortKeys + 1));
    EXPECT_FALSE(short_heads_run(loops, torch::kDouble, 16, 16));
    for (const auto half : {torch::kBFloat16, torch::kHalf}) {
      EXPECT_EQ(short_heads_run(loops, half, kMaxShortQueries, kMaxShortKeys), short_loops);
      EXPECT_FALSE(short_heads_run(loops, half, kMaxShortQueries + 1, kMaxShortKeys));
    }
  });
}

TEST(FusedKernel, BackwardSplitAcrossKeyRangesMatchesTheMathPath) {
  // Fewer heads than threads: the backward splits each head's 1300 keys
  // (three key blocks) into ranges, each with its own share of dQ.
  for (const int threads : {2, 4}) {
    for (const bool causal : {false, true}) {
      KernelCase c{
          1,
          2,
          1,
          130,
          1300,
          16,
          8,
          MaskKind::float_per_head,
          causal,
          1170,
          700,
          /*empty_row=*/true,
          torch::kFloat,
          threads};
      SCOPED_TRACE(c.describe());
      ThreadCount thread_count(threads);
      const KernelRun run(c);
      const auto out = attn::detail::fused_attention(
          attn::testing::kernel_plan(FusedLoops::tiled), run.params);
      EXPECT_CLOSE(out, run.math_out, run.tolerance);
      run.expect_same_gradients({out}, {run.math_out}, {torch::randn(out.sizes())});
    }
  }
}

TEST(FusedKernel, FullyMaskedRowsGiveZeroOutputAndZeroGradients) {
  torch::manual_seed(3);
  auto q = torch::randn({1, 2, 70, 8}).requires_grad_();
  auto k = torch::randn({1, 2, 600, 8}).requires_grad_();
  auto v = torch::randn({1, 2, 600, 8}).requires_grad_();
  auto allowed = torch::ones({1, 2, 70, 600}, torch::kBool);
  allowed.select(2, 66).fill_(false); // a row in the second query tile
  auto params = kernel_params(q, k, v, 0.3, /*causal=*/false);
  params.mask = allowed;
  const auto out = attn::detail::fused_attention(
      attn::testing::kernel_plan(FusedLoops::tiled), params);
  EXPECT_EQ(out.select(2, 66).abs().max().item<float>(), 0.0f);
  const auto dq = torch::autograd::grad({out.sum()}, {q})[0];
  EXPECT_EQ(dq.select(2, 66).abs().max().item<float>(), 0.0f);
  EXPECT_TRUE(torch::isfinite(dq).all().item<bool>());
}

TEST(FusedKernel, TheGradientOfOneProjectionIsOneTensorOfItsLayout) {
  // Q, K and V handed over as the heads of one projection qkv (B, L, 3,
  // H, D), as MultiHeadAttention's one product leaves them, in (B, L) and
  // (L, B) memory: the gradient is qkv's, the three heads' gradients of
  // the float64 math path stacked; where few query tiles accumulate (L =
  // 40, both sets of loops), it has qkv's strides, written in place.
  torch::manual_seed(5);
  const int64_t B = 2, H = 2, D = 8;
  for (const int64_t L : {int64_t{40}, 3 * attn::detail::kQueryTile}) {
    for (const bool batch_first : {true, false}) {
      for (const auto loops : {FusedLoops::tiled, FusedLoops::short_heads}) {
        if (loops == FusedLoops::short_heads && L > 64) {
          continue; // beyond the short heads' bounds
        }
        SCOPED_TRACE(
            ::testing::Message() << "L " << L
                                 << (batch_first ? ", (B, L) memory" : ", (L, B) memory")
                                 << (loops == FusedLoops::tiled ? ", tiled" : ", short heads"));
        const auto dtype = loops == FusedLoops::tiled ? torch::kDouble : torch::kFloat;
        const auto qkv = batch_first
            ? torch::randn({B, L, 3, H, D}, dtype).requires_grad_()
            : torch::randn({L, B, 3, H, D}, dtype).transpose(0, 1).detach().requires_grad_();
        const auto heads = attn::detail::heads_of_projection(qkv);
        auto params = kernel_params(heads.q, heads.k, heads.v, 0.3, /*causal=*/true);
        params.qkv = qkv;
        const auto out = attn::detail::fused_attention(attn::testing::kernel_plan(loops), params);
        const auto grad_out = torch::randn(out.sizes(), out.options());
        const auto grad = torch::autograd::grad({out}, {qkv}, {grad_out})[0];

        const auto leaves = qkv.detach().to(torch::kDouble).requires_grad_();
        const auto exact = attn::detail::heads_of_projection(leaves);
        const auto [math_out, w] = attn::detail::math_attention(
            kernel_params(exact.q, exact.k, exact.v, 0.3, /*causal=*/true));
        const auto expected = torch::autograd::grad(
            {math_out}, {leaves}, {grad_out.to(torch::kDouble)})[0];
        EXPECT_CLOSE(out.to(torch::kDouble), math_out, tolerance_for(dtype));
        EXPECT_CLOSE(grad.to(torch::kDouble), expected, tolerance_for(dtype));
        if (L <= 2 * attn::detail::kQueryTile) {
          EXPECT_EQ(grad.strides(), qkv.strides());
        }
      }
    }
  }
}

// A differentiable call's backward runs on its forward's plan: the plan
// kept in an autograd context comes back whole, its loops those of its
// level.
TEST(KernelPlan, KeptInAnAutogradContextComesBackWhole) {
  using attn::detail::FusedLoops;
  for (const auto level : attn::detail::cpu_levels()) {
    for (const auto loops : {FusedLoops::tiled, FusedLoops::short_heads}) {
      for (const bool keeps : {false, true}) {
        SCOPED_TRACE(
            std::string(attn::detail::cpu_level_name(level)) + " keeps=" + std::to_string(keeps));
        const attn::detail::KernelPlan plan{attn::detail::cpu_loops(level), loops, keeps};
        torch::autograd::AutogradContext ctx;
        plan.save_to(ctx);
        const auto back = attn::detail::KernelPlan::restore_from(ctx);
        EXPECT_EQ(back.cpu.level, level);
        EXPECT_EQ(back.cpu.isa, plan.cpu.isa);
        EXPECT_EQ(back.cpu.bf16, plan.cpu.bf16);
        EXPECT_EQ(back.cpu.amx, plan.cpu.amx);
        EXPECT_EQ(back.fused_loops, loops);
        EXPECT_EQ(back.keeps_out_rounding, keeps);
      }
    }
  }
}

TEST(FusedKernel, ReadsStridedHeadsAndWritesInterleavedOutput) {
  // (B, L, H, D) memory seen as (B, H, L, D), as MultiHeadAttention passes it.
  torch::manual_seed(4);
  const auto x = torch::randn({2, 9, 3, 16});
  const auto q = x.transpose(1, 2);
  const auto out = attn::detail::fused_attention(
      attn::testing::kernel_plan(FusedLoops::tiled), kernel_params(q, q, q, 0.25, /*causal=*/true));
  const auto [math_out, w] = attn::detail::math_attention(
      kernel_params(q.contiguous(), q.contiguous(), q.contiguous(), 0.25, /*causal=*/true));
  EXPECT_CLOSE(out, math_out, Tolerance{1e-6});
  EXPECT_TRUE(out.transpose(1, 2).is_contiguous());
}

} // namespace
