// The tiled loops read keys and values through a source alone
// (src/kernels/cpu/key_value_source.h): a source that stores each head's
// keys in pages scattered over one pool, as a paged cache does (vLLM's
// block tables, FlashAttention's block_table), gives the dense source's
// results bit for bit, in every dtype's operand policy, forward and
// backward; in float64 both equal the float64 formula softmax(Q Kᵀ /
// √d_k + mask) V (Vaswani et al., 2017) and its gradients.

#include "test_support.h"

#include "kernels/cpu/key_value_source.h"
#include "kernels/cpu/operands_bf16.h"
#include "kernels/cpu/operands_float.h"
#include "kernels/cpu/operands_float16.h"
#include "kernels/cpu/tiled_template.h"
#include "kernels/cpu/workspace.h"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <vector>

namespace {

using attn::detail::AttentionParams;
using attn::detail::ForwardResult;
using attn::detail::InputGradients;
using attn::detail::KeyOrValue;
using attn::detail::MatrixRef;
using attn::detail::OperandDirection;
using attn::detail::TiledInputs;

// Keys and values as a paged cache stores them: each (b, kv head)'s keys
// in pages of kPage keys, the pages of every head scattered over one pool
// in a shuffled order. A block of keys inside one page is read where it
// is; a block over several pages is gathered into the task's buffer.
template <typename ElementType>
class ScatteredPages {
 public:
  using Element = ElementType;
  struct Buffer {
    std::vector<Element> rows;
  };
  static constexpr int64_t kPage = 16;

  explicit ScatteredPages(const AttentionParams& params)
      : batch_(params.k.size(0)),
        heads_(params.k.size(1)),
        length_(params.k.size(2)),
        pages_per_head_((length_ + kPage - 1) / kPage),
        keys_(paged(params.k)),
        values_(paged(params.v)) {}

  int64_t batch() const { return batch_; }
  int64_t kv_heads() const { return heads_; }
  int64_t length() const { return length_; }
  int64_t width(KeyOrValue which) const { return of(which).width; }
  static bool features_contiguous(KeyOrValue /*which*/) { return true; }

  MatrixRef<Element> rows(
      KeyOrValue which,
      int64_t b,
      int64_t kv_head,
      int64_t first,
      int64_t count,
      Buffer& buffer) const {
    const int64_t width = this->width(which);
    if (count == 0) {
      return {nullptr, 0, width, width, 1};
    }
    if (first / kPage == (first + count - 1) / kPage) {
      return page(which, b, kv_head, first / kPage).row_block(first % kPage, count);
    }
    buffer.rows.resize(static_cast<size_t>(count * width));
    for (int64_t r = 0; r < count; ++r) {
      const Element* key = page(which, b, kv_head, (first + r) / kPage).row((first + r) % kPage);
      std::copy(key, key + width, buffer.rows.data() + r * width);
    }
    return {buffer.rows.data(), count, width, width, 1};
  }

  template <typename Visit>
  void for_each_run(KeyOrValue which, int64_t b, int64_t kv_head, const Visit& visit) const {
    for (int64_t p = 0; p < pages_per_head_; ++p) {
      const int64_t first = p * kPage;
      visit(first, page(which, b, kv_head, p).row_block(0, std::min(kPage, length_ - first)));
    }
  }

 private:
  struct Pool {
    torch::Tensor memory;      // (pages, kPage, width)
    std::vector<int64_t> page; // per (b, kv head, page of the head): its page in memory
    int64_t width = 0;
  };

  Pool paged(const torch::Tensor& t) const {
    Pool pool;
    pool.width = t.size(3);
    const int64_t pages = batch_ * heads_ * pages_per_head_;
    pool.page.resize(static_cast<size_t>(pages));
    std::iota(pool.page.begin(), pool.page.end(), int64_t{0});
    std::shuffle(pool.page.begin(), pool.page.end(), std::mt19937(pages));
    pool.memory = torch::zeros({pages, kPage, pool.width}, t.options());
    for (int64_t i = 0; i < pages; ++i) {
      const int64_t head = i / pages_per_head_, first = i % pages_per_head_ * kPage;
      const int64_t n = std::min(kPage, length_ - first);
      pool.memory[pool.page[static_cast<size_t>(i)]].narrow(0, 0, n).copy_(
          t[head / heads_][head % heads_].narrow(0, first, n));
    }
    return pool;
  }

  const Pool& of(KeyOrValue which) const { return which == KeyOrValue::key ? keys_ : values_; }

  MatrixRef<Element> page(KeyOrValue which, int64_t b, int64_t kv_head, int64_t p) const {
    const Pool& pool = of(which);
    const int64_t at = pool.page[static_cast<size_t>((b * heads_ + kv_head) * pages_per_head_ + p)];
    return {
        pool.memory.template data_ptr<Element>() + at * kPage * pool.width, kPage, pool.width,
        pool.width, 1};
  }

  int64_t batch_, heads_, length_, pages_per_head_;
  Pool keys_, values_;
};

struct SourceCase {
  torch::ScalarType dtype;
  int64_t L, S;
  bool causal;

  std::string describe() const {
    std::ostringstream name;
    name << c10::toString(dtype) << " L=" << L << " S=" << S << (causal ? " causal" : "");
    return name.str();
  }
};

// q (2, 4, L, 24), k (2, 2, S, 24), v (2, 2, S, 16): two query heads per
// kv head; S over a key block (512) in the long cases.
AttentionParams source_params(const SourceCase& c) {
  torch::manual_seed(c.L * 1000 + c.S);
  const auto options = torch::dtype(c.dtype);
  AttentionParams params;
  params.q = torch::randn({2, 4, c.L, 24}, options);
  params.k = torch::randn({2, 2, c.S, 24}, options);
  params.v = torch::randn({2, 2, c.S, 16}, options);
  params.scale = 1.0 / std::sqrt(24.0);
  params.causal = c.causal;
  params.query_offset = c.S - c.L; // the last queries, as a cache's
  return params;
}

// NaN in this thread's buffers for what a policy makes once per call
// (workspace.h), so that a copy it leaves partly unwritten cannot pass on
// the last call's contents.
void poison_workspace() {
  using attn::detail::WorkspaceSlot;
  for (const auto slot :
       {WorkspaceSlot::keys_transposed, WorkspaceSlot::values_transposed,
        WorkspaceSlot::keys_in_pairs}) {
    attn::detail::workspace_tensor(
        slot, {static_cast<int64_t>(attn::detail::kMaxWorkspaceBytes / sizeof(float))},
        torch::dtype(torch::kFloat))
        .fill_(std::numeric_limits<float>::quiet_NaN());
  }
}

// The dtype the kernels compute scores and accumulate in: float for half
// precision, else the inputs' own.
torch::ScalarType score_dtype(const AttentionParams& params) {
  const auto dtype = params.q.scalar_type();
  return attn::detail::is_half_precision(dtype) ? torch::kFloat : dtype;
}

template <typename Operands>
ForwardResult forward_on(const AttentionParams& params, const attn::detail::CpuLoops& loops) {
  poison_workspace();
  const ForwardResult result{
      torch::empty({params.B(), params.H(), params.L(), params.Dv()}, params.q.options()),
      torch::empty({params.B(), params.H(), params.L()}, torch::dtype(score_dtype(params)))};
  attn::detail::tiled_forward_loops(
      TiledInputs<Operands>(params, OperandDirection::forward, loops), result);
  return result;
}

// dq, and dk and dv per query head, as the kernels write them.
template <typename Operands>
InputGradients backward_on(
    const AttentionParams& params,
    const attn::detail::CpuLoops& loops,
    const ForwardResult& forward,
    const torch::Tensor& grad_out) {
  const auto key_dtype = score_dtype(params);
  poison_workspace();
  InputGradients grads;
  grads.dq = torch::empty(params.q.sizes(), params.q.options());
  grads.dk = torch::empty(
      {params.B(), params.H(), params.S(), params.D()}, torch::dtype(key_dtype));
  grads.dv = torch::empty(
      {params.B(), params.H(), params.S(), params.Dv()}, torch::dtype(key_dtype));
  attn::detail::tiled_backward_loops(
      TiledInputs<Operands>(params, OperandDirection::backward, loops), forward, grad_out, grads);
  return grads;
}

// What the scattered source's loops computed for a request.
struct ScatteredRun {
  ForwardResult forward;
  torch::Tensor grad_out;
  InputGradients grads;
};

// The dense and the scattered source's forward and backward, bit for bit;
// returns the scattered one's.
template <typename Dense, typename Scattered>
ScatteredRun expect_same_on_both_sources(
    const AttentionParams& params,
    const attn::detail::CpuLoops& loops) {
  const auto dense = forward_on<Dense>(params, loops);
  const auto scattered = forward_on<Scattered>(params, loops);
  EXPECT_TRUE(torch::equal(dense.out, scattered.out));
  EXPECT_TRUE(torch::equal(dense.lse, scattered.lse));
  const auto grad_out = torch::randn_like(dense.out);
  const auto dense_grads = backward_on<Dense>(params, loops, dense, grad_out);
  const auto grads = backward_on<Scattered>(params, loops, scattered, grad_out);
  EXPECT_TRUE(torch::equal(dense_grads.dq, grads.dq));
  EXPECT_TRUE(torch::equal(dense_grads.dk, grads.dk));
  EXPECT_TRUE(torch::equal(dense_grads.dv, grads.dv));
  return {scattered, grad_out, grads};
}

// softmax(Q Kᵀ·scale + mask) V and its gradients in float64, each kv
// head repeated for its query heads; dk and dv per query head.
std::pair<torch::Tensor, InputGradients> attention_formula(
    const AttentionParams& params,
    const torch::Tensor& grad_out) {
  const int64_t group = params.group();
  auto q = params.q.to(torch::kDouble).requires_grad_();
  auto k = params.k.to(torch::kDouble).repeat_interleave(group, 1).detach().requires_grad_();
  auto v = params.v.to(torch::kDouble).repeat_interleave(group, 1).detach().requires_grad_();
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * params.scale;
  if (params.causal) {
    const auto query = torch::arange(params.L()).unsqueeze(1) + params.query_offset;
    const auto key = torch::arange(params.S()).unsqueeze(0);
    scores = scores.masked_fill(key > query, -std::numeric_limits<double>::infinity());
  }
  const auto out = torch::matmul(torch::softmax(scores, -1), v);
  out.backward(grad_out.to(torch::kDouble));
  InputGradients grads;
  grads.dq = q.grad();
  grads.dk = k.grad();
  grads.dv = v.grad();
  return {out.detach(), grads};
}

std::vector<SourceCase> source_cases(torch::ScalarType dtype) {
  // A decoding step (one query: float32 reads Kᵀ in place, blocks over
  // pages gathered), prefill of two query tiles over two key blocks.
  return {{dtype, 1, 77, false}, {dtype, 130, 530, true}, {dtype, 130, 530, false}};
}

TEST(KeyValueSource, ScatteredPagesGiveTheDenseResultsInEveryPolicy) {
  using attn::detail::Bf16Operands;
  using attn::detail::Float16Operands;
  using attn::detail::FloatOperands;
  const auto loops = attn::testing::widest_loops();
  for (const auto& c : source_cases(torch::kFloat)) {
    SCOPED_TRACE(c.describe());
    expect_same_on_both_sources<FloatOperands<float>, FloatOperands<float, ScatteredPages<float>>>(
        source_params(c), loops);
  }
  const bool bf16 = Bf16Operands<>::runs(loops), half = Float16Operands<>::runs(loops);
  for (const auto& c : source_cases(torch::kBFloat16)) {
    if (!bf16) {
      std::cout << "[ NOTE ] no bfloat16 products on this CPU: its policy is not compared\n";
      break;
    }
    SCOPED_TRACE(c.describe());
    expect_same_on_both_sources<Bf16Operands<>, Bf16Operands<ScatteredPages<c10::BFloat16>>>(
        source_params(c), loops);
  }
  for (const auto& c : source_cases(torch::kHalf)) {
    if (!half) {
      std::cout << "[ NOTE ] no float16 products on this CPU: its policy is not compared\n";
      break;
    }
    SCOPED_TRACE(c.describe());
    expect_same_on_both_sources<Float16Operands<>, Float16Operands<ScatteredPages<c10::Half>>>(
        source_params(c), loops);
  }
}

TEST(KeyValueSource, ScatteredPagesInFloat64MatchTheFormula) {
  using attn::detail::FloatOperands;
  const auto loops = attn::testing::widest_loops();
  for (const auto& c : source_cases(torch::kDouble)) {
    SCOPED_TRACE(c.describe());
    const auto params = source_params(c);
    const auto run = expect_same_on_both_sources<
        FloatOperands<double>, FloatOperands<double, ScatteredPages<double>>>(params, loops);
    const auto [out, expected] = attention_formula(params, run.grad_out);
    EXPECT_CLOSE(run.forward.out, out, attn::testing::kFloat64Tolerance);
    EXPECT_CLOSE(run.grads.dq, expected.dq, attn::testing::kFloat64Tolerance);
    EXPECT_CLOSE(run.grads.dk, expected.dk, attn::testing::kFloat64Tolerance);
    EXPECT_CLOSE(run.grads.dv, expected.dv, attn::testing::kFloat64Tolerance);
  }
}

} // namespace
