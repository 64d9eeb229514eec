// attn::RotaryEmbedding (src/modules/rotary_embedding.cpp) against RoPE
// written out element by element, and the property it exists for: rotated
// queries and keys score by their relative position only.

#include "test_support.h"

#include <attn/modules/rotary_embedding.h>

#include <cmath>
#include <sstream>

namespace {

using attn::RotaryEmbedding;
using attn::RotaryEmbeddingOptions;
using attn::testing::kFloat64Tolerance;
using attn::testing::Tolerance;

// RoPE from its definition, in float64 loops: pair i of the first `dim`
// features, (a, b), at position p becomes (a cos θ - b sin θ, b cos θ +
// a sin θ) with θ = p · base^(-2i / dim). The pair is (i, i + dim/2), or
// (2i, 2i + 1) when interleaved. x is (N, T, F); token t at offset + t.
torch::Tensor rope_by_formula(
    const torch::Tensor& x,
    int64_t dim,
    double base,
    bool interleaved,
    int64_t offset) {
  auto in = x.to(torch::kDouble).contiguous();
  auto out = in.clone();
  const auto a_in = in.accessor<double, 3>();
  auto a_out = out.accessor<double, 3>();
  for (int64_t n = 0; n < in.size(0); ++n) {
    for (int64_t t = 0; t < in.size(1); ++t) {
      for (int64_t i = 0; i < dim / 2; ++i) {
        const double theta = static_cast<double>(offset + t) *
            std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
        const int64_t first = interleaved ? 2 * i : i;
        const int64_t second = interleaved ? 2 * i + 1 : i + dim / 2;
        const double a = a_in[n][t][first], b = a_in[n][t][second];
        a_out[n][t][first] = a * std::cos(theta) - b * std::sin(theta);
        a_out[n][t][second] = b * std::cos(theta) + a * std::sin(theta);
      }
    }
  }
  return out;
}

struct RopeCase {
  int64_t dim, features;
  double base;
  bool interleaved;
  int64_t offset;
};

class RotaryFormula : public ::testing::TestWithParam<RopeCase> {};

TEST_P(RotaryFormula, MatchesTheFormulaInFloat64AndFloat32) {
  const auto& c = GetParam();
  torch::manual_seed(1);
  RotaryEmbedding rope(RotaryEmbeddingOptions(c.dim).base(c.base).interleaved(c.interleaved));
  const auto x = torch::randn({3, 7, c.features}, torch::kDouble);
  const auto expected = rope_by_formula(x, c.dim, c.base, c.interleaved, c.offset);
  // float64: the tables are exact to rounding; float32: the angle is
  // computed in float64 and rounded once, so only the products round.
  EXPECT_CLOSE(rope(x, c.offset), expected, kFloat64Tolerance);
  EXPECT_CLOSE(rope(x.to(torch::kFloat), c.offset), expected, Tolerance{2e-6});
  // Features past dim pass through untouched.
  if (c.features > c.dim) {
    EXPECT_TRUE(torch::equal(
        rope(x, c.offset).narrow(-1, c.dim, c.features - c.dim),
        x.narrow(-1, c.dim, c.features - c.dim)));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases,
    RotaryFormula,
    ::testing::Values(
        RopeCase{8, 8, 10000.0, false, 0},
        RopeCase{8, 8, 10000.0, true, 0},
        RopeCase{4, 10, 500.0, false, 3},
        RopeCase{6, 16, 10000.0, true, 1000},
        RopeCase{64, 64, 500000.0, false, 70000}));

TEST(RotaryEmbedding, ScoresDependOnlyOnRelativePosition) {
  torch::manual_seed(2);
  for (const bool interleaved : {false, true}) {
    RotaryEmbedding rope(RotaryEmbeddingOptions(16).interleaved(interleaved));
    const auto q = torch::randn({1, 1, 16}, torch::kDouble);
    const auto k = torch::randn({1, 1, 16}, torch::kDouble);
    const auto score = [&](int64_t query_position, int64_t key_position) {
      return (rope(q, query_position) * rope(k, key_position)).sum().item<double>();
    };
    for (const auto& [m, n] : {std::pair{5, 2}, std::pair{0, 9}, std::pair{300, 300}}) {
      for (const int64_t shift : {1, 17, 4000}) {
        EXPECT_NEAR(score(m, n), score(m + shift, n + shift), 1e-10)
            << "m=" << m << " n=" << n << " shift=" << shift << " interleaved=" << interleaved;
      }
    }
    // And they do depend on the distance.
    EXPECT_GT(std::abs(score(5, 2) - score(5, 3)), 1e-6);
    // Rotation keeps norms.
    EXPECT_NEAR(rope(q, 123).norm().item<double>(), q.norm().item<double>(), 1e-12);
  }
}

TEST(RotaryEmbedding, OffsetContinuesThePositionsOfAnEarlierCall) {
  // What a KV cache relies on: tokens rotated one at a time at offsets
  // 0..T-1 equal the sequence rotated at once, past the first table size.
  torch::manual_seed(3);
  RotaryEmbedding rope(32);
  const auto x = torch::randn({2, 4, 600, 32});
  const auto whole = rope(x);
  for (const int64_t t : {0, 255, 256, 599}) {
    EXPECT_TRUE(torch::equal(rope(x.narrow(2, t, 1), t), whole.narrow(2, t, 1))) << "t=" << t;
  }
}

TEST(RotaryEmbedding, PositionsPlaceEachTokenWhereTheyPoint) {
  // Per-token positions (packed documents restart at 0; a ragged cache
  // continues each row from its own length), some past the cached tables.
  torch::manual_seed(7);
  RotaryEmbedding rope(RotaryEmbeddingOptions(6).interleaved(true));
  const auto x = torch::randn({2, 3, 5, 10}, torch::kDouble);
  const auto rows = torch::tensor({{0, 1, 2, 0, 1}, {7, 70000, 3, 3, 0}}, torch::kLong);
  const auto by_row = rope->rotate(x, rows);
  const auto shared = rope->rotate(x, rows[0]);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t t = 0; t < 5; ++t) {
      const auto token = x[b].narrow(1, t, 1); // (3, 1, F)
      EXPECT_CLOSE(
          by_row[b].narrow(1, t, 1),
          rope_by_formula(token, 6, 10000.0, true, rows[b][t].item<int64_t>()), kFloat64Tolerance)
          << "b=" << b << " t=" << t;
      EXPECT_CLOSE(
          shared[b].narrow(1, t, 1),
          rope_by_formula(token, 6, 10000.0, true, rows[0][t].item<int64_t>()), kFloat64Tolerance);
    }
  }
}

TEST(RotaryEmbedding, GradientIsTheInverseRotation) {
  // y = R x with R orthogonal, so dL/dx = Rᵀ dL/dy = rotation by -θ.
  torch::manual_seed(4);
  RotaryEmbedding rope(8);
  auto x = torch::randn({2, 5, 8}, torch::kDouble).requires_grad_();
  const auto upstream = torch::randn({2, 5, 8}, torch::kDouble);
  const auto grad = torch::autograd::grad({rope(x, 7)}, {x}, {upstream})[0];
  // Rotating the gradient forward again must give back the upstream.
  EXPECT_CLOSE(rope(grad, 7), upstream, kFloat64Tolerance);
}

TEST(RotaryEmbedding, KeepsTablesPerDtypeAndAClonesOwnCache) {
  torch::manual_seed(5);
  RotaryEmbedding rope(4);
  const auto x = torch::randn({1, 3, 4}, torch::kDouble);
  const auto as_float = rope(x.to(torch::kFloat), 2);
  const auto as_double = rope(x, 2);
  EXPECT_EQ(as_float.scalar_type(), torch::kFloat);
  EXPECT_EQ(as_double.scalar_type(), torch::kDouble);
  EXPECT_CLOSE(as_float, as_double, Tolerance{1e-6});
  const auto copy = std::dynamic_pointer_cast<attn::RotaryEmbeddingImpl>(rope->clone());
  ASSERT_TRUE(copy);
  EXPECT_TRUE(torch::equal(copy->forward(x, 2), as_double));
  EXPECT_EQ(rope->parameters().size(), 0u);
  EXPECT_EQ(rope->buffers().size(), 0u);
}

TEST(RotaryEmbedding, PrettyPrintsItsOptions) {
  std::ostringstream printed;
  printed << *RotaryEmbedding(RotaryEmbeddingOptions(64).base(500000).interleaved(true));
  EXPECT_EQ(printed.str(), "attn::RotaryEmbedding(dim=64, base=500000, interleaved=true)");
}

TEST(RotaryEmbeddingErrors, NameWhatWasExpectedAndWhatArrived) {
  EXPECT_ATTN_ERROR(
      RotaryEmbedding(7),
      "RotaryEmbedding: dim must be a positive even number of features (they rotate in pairs), got 7");
  EXPECT_ATTN_ERROR(RotaryEmbedding(0), "dim must be a positive even number of features");
  EXPECT_ATTN_ERROR(
      RotaryEmbedding(RotaryEmbeddingOptions(8).base(-1)),
      "RotaryEmbedding: base must be a positive finite number, got -1");
  RotaryEmbedding rope(8);
  EXPECT_ATTN_ERROR(
      rope(torch::randn({2, 3, 6})),
      "RotaryEmbedding: x must be (..., T, F) with F >= dim = 8, got [2, 3, 6]");
  EXPECT_ATTN_ERROR(rope(torch::randn({8})), "x must be (..., T, F) with F >= dim = 8, got [8]");
  EXPECT_ATTN_ERROR(
      rope(torch::ones({2, 8}, torch::kLong)),
      "RotaryEmbedding: x must have a floating-point dtype, got Long");
  EXPECT_ATTN_ERROR(rope(torch::randn({2, 8}), -1), "RotaryEmbedding: offset must be >= 0, got -1");
  EXPECT_ATTN_ERROR(rope(torch::Tensor()), "RotaryEmbedding: x must be a defined tensor");
  const auto x = torch::randn({2, 3, 4, 8});
  EXPECT_ATTN_ERROR(
      rope->rotate(x, torch::zeros({3, 4}, torch::kLong)),
      "RotaryEmbedding: positions must be (T) = (4) or (B, T) = (2, 4) for x [2, 3, 4, 8], got [3, 4]");
  EXPECT_ATTN_ERROR(
      rope->rotate(x, torch::zeros({4})), "RotaryEmbedding: positions must be integers, got Float");
  EXPECT_ATTN_ERROR(
      rope->rotate(x, torch::tensor({0, 1, -1, 2})),
      "RotaryEmbedding: positions must lie in [0, 2^53) (exact in float64), got -1 to 2");
  EXPECT_ATTN_ERROR(
      rope->rotate(x, torch::Tensor()), "RotaryEmbedding: positions must be a defined tensor");
}

} // namespace
