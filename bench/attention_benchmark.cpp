// attn against torch::nn::MultiheadAttention and the textbook naive
// composite (and, on CUDA, LibTorch's own at::scaled_dot_product_attention),
// side by side in one process at one fixed thread count.
//
// Counters: GFLOP/s (attention 4·B·H·L·S·D, halved when causal; each
// projection 2·B·T·E·E'; forward+backward counted as 3× the forward),
// peak_MiB (CPU tensor memory allocated on top of what existed before the
// call), and, in the context, this machine's sgemm GFLOP/s at the same
// thread count. Threads: ATTN_BENCH_THREADS, default all cores.
//
// ATTN_BENCH_DEVICE=cuda runs the CUDA suite instead: the same cases in
// float32, bfloat16 and float16 (T = 512 … 8192), each timed call followed
// by a device synchronisation, named cuda_<dtype>_<group>/<impl>/....

#include <attn/attn.h>

#include "naive_attention.h"
#include "runtime/compat.h" // LibTorch's own attention, where the version has it

#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t kEmbed = 512;
constexpr int64_t kHeads = 8;
constexpr int64_t kHeadDim = kEmbed / kHeads;

// ---------------------------------------------------------------------------
// Tensor memory accounting: wraps the CPU allocator to track live and peak
// bytes.

// The returned DataPtr's context is its data pointer, as LibTorch 2.x's
// raw_allocate (used inside some of its kernels) requires; each block's
// size and the inner allocator's DataPtr are kept in a table until freed.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t bytes) ATTN_ALLOCATE_CONST override {
    auto inner = inner_->allocate(bytes);
    void* data = inner.get();
    const auto now = live_ += static_cast<int64_t>(bytes);
    int64_t seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
    if (data == nullptr) { // zero bytes: nothing to free
      return {nullptr, nullptr, &release, c10::Device(c10::kCPU)};
    }
    const std::lock_guard<std::mutex> lock(mutex_);
    blocks_.emplace(data, Block{std::move(inner), bytes});
    return {data, data, &release, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  // Required by LibTorch >= 2.3 (where it is pure virtual); plain method before.
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::memcpy(dest, src, count);
  }

  // Starts a measurement; returns the baseline.
  int64_t reset_peak() const {
    peak_ = live_.load();
    return peak_;
  }
  int64_t peak() const { return peak_; }

 private:
  struct Block {
    c10::DataPtr inner;
    size_t bytes;
  };

  static void release(void* data);

  c10::Allocator* inner_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, Block> blocks_;
  mutable std::atomic<int64_t> live_{0};
  mutable std::atomic<int64_t> peak_{0};
};

CountingAllocator& counting_allocator() {
  static CountingAllocator allocator(c10::GetDefaultCPUAllocator());
  return allocator;
}

void CountingAllocator::release(void* data) {
  if (data == nullptr) {
    return;
  }
  auto& self = counting_allocator();
  c10::DataPtr inner; // freed outside the lock
  {
    const std::lock_guard<std::mutex> lock(self.mutex_);
    const auto block = self.blocks_.find(data);
    TORCH_INTERNAL_ASSERT(
        block != self.blocks_.end(), "freeing memory this allocator did not give");
    self.live_ -= static_cast<int64_t>(block->second.bytes);
    inner = std::move(block->second.inner);
    self.blocks_.erase(block);
  }
}

// ---------------------------------------------------------------------------
// Threads: ATen's pool and the BLAS's own, set to one count for everyone.

int configure_threads() {
  const char* env = std::getenv("ATTN_BENCH_THREADS");
  const int threads = env ? std::max(1, std::atoi(env))
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(threads);
  // OpenBLAS keeps its own pool; other BLAS builds follow ATen or OMP.
  using SetThreads = void (*)(int);
  if (auto* set_blas = reinterpret_cast<SetThreads>(
          dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set_blas(threads);
  }
  return threads;
}

double sgemm_gflops() {
  torch::NoGradGuard no_grad;
  const auto a = torch::randn({1024, 1024}), b = torch::randn({1024, 1024});
  auto c = torch::mm(a, b);
  constexpr int kRepeats = 20;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kRepeats; ++i) {
    torch::mm_out(c, a, b);
  }
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return kRepeats * 2.0 * 1024 * 1024 * 1024 / elapsed.count() / 1e9;
}

// ---------------------------------------------------------------------------
// The implementations.

enum class Impl {
  ours,
  ours_weights,
  builtin,
  builtin_weights,
  naive,
  aten_sdpa,
  ours_window,
  ours_bias,
  ours_learned_bias,
  attn_default
};

const char* impl_name(Impl impl) {
  switch (impl) {
    case Impl::ours: return "ours";
    case Impl::ours_weights: return "ours_need_weights";
    case Impl::builtin: return "builtin";
    case Impl::builtin_weights: return "builtin_need_weights";
    case Impl::naive: return "naive";
    case Impl::aten_sdpa: return "aten_sdpa";
    case Impl::ours_window: return "ours_window";
    case Impl::ours_bias: return "ours_bias";
    case Impl::ours_learned_bias: return "ours_learned_bias";
    case Impl::attn_default: return "attn_default";
  }
  return "";
}

struct NaiveMultiHeadAttention {
  torch::nn::Linear w_q{kEmbed, kEmbed}, w_k{kEmbed, kEmbed}, w_v{kEmbed, kEmbed},
      w_o{kEmbed, kEmbed};

  torch::Tensor split_heads(const torch::Tensor& x) const {
    return x.view({x.size(0), x.size(1), kHeads, kHeadDim}).transpose(1, 2); // (B, H, T, D)
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& allowed) {
    const auto out = attn::bench::naive_attention(
        split_heads(w_q(x)), split_heads(w_k(x)), split_heads(w_v(x)), allowed);
    return w_o(out.transpose(1, 2).contiguous().view(x.sizes())); // (B, T, E)
  }
};

struct Case {
  int64_t T, B;
  bool causal;
};

// Where and in which dtype a suite runs.
struct Target {
  torch::Device device;
  torch::ScalarType dtype;

  torch::TensorOptions options() const { return torch::TensorOptions(dtype).device(device); }
  // "" for the CPU float32 suite, else "cuda_bfloat16_" and the like.
  std::string prefix() const {
    if (device.is_cpu() && dtype == torch::kFloat) {
      return "";
    }
    const char* name = dtype == torch::kFloat ? "float32"
        : dtype == torch::kBFloat16           ? "bfloat16"
                                              : "float16";
    return std::string(device.is_cuda() ? "cuda_" : "cpu_") + name + "_";
  }
};

Case read_case(const benchmark::State& state) {
  return {state.range(0), state.range(1), state.range(2) != 0};
}

double attention_flops(const Case& c) {
  return 4.0 * c.B * kHeads * c.T * c.T * kHeadDim * (c.causal ? 0.5 : 1.0);
}

// The sliding window of the ours_window cases.
constexpr int64_t kWindow = 512;

// Attention FLOPs over the query-key pairs a window of kWindow leaves.
double windowed_attention_flops(const Case& c) {
  double pairs = 0;
  for (int64_t i = 0; i < c.T; ++i) {
    const int64_t last = c.causal ? i : std::min(c.T - 1, i + kWindow - 1);
    pairs += static_cast<double>(last - std::max<int64_t>(0, i - kWindow + 1) + 1);
  }
  return 4.0 * c.B * kHeads * kHeadDim * pairs;
}
double projection_flops(const Case& c) {
  return 4 * 2.0 * c.B * c.T * kEmbed * kEmbed;
}

// Runs `step` under the state's timing loop and records the counters.
// On CUDA each call is followed by a synchronisation, so the time is the
// kernels' and not the launch's.
template <typename Step>
void measure(benchmark::State& state, double flops, const Target& target, Step&& step) {
  const auto run = [&] {
    step();
    if (target.device.is_cuda()) {
      torch::cuda::synchronize();
    }
  };
  if (state.range(0) < 4096 || target.device.is_cuda()) {
    run(); // warm-up: first-touch allocations, kernel selection
  }
  const int64_t baseline = counting_allocator().reset_peak();
  for (auto _ : state) {
    run();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      flops * static_cast<double>(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
  state.counters["peak_MiB"] = static_cast<double>(counting_allocator().peak() - baseline) /
      (1 << 20);
}

// ---------------------------------------------------------------------------
// Benchmarks.

// The longest T of the ours_bias rows.
constexpr int64_t kLongestBias = 2048;

// The attention core on (B, H, T, D) inputs; `backward` adds a backward
// pass to every input. `ours` is attn's fused kernel (asked for by name);
// `ours_bias` the same with an additive (B, H, T, T) mask in the inputs'
// dtype, such as a per-head bias (T <= kLongestBias); `ours_learned_bias`
// with that mask learned (its gradient taken with the inputs'),
// `attn_default` the call with no option but causality: whatever
// attn::select_backend picks for it.
void attention_core(benchmark::State& state, Impl impl, bool backward, const Target& target) {
  const auto c = read_case(state);
  const auto input = [&] {
    return torch::randn({c.B, kHeads, c.T, kHeadDim}, target.options()).requires_grad_(backward);
  };
  const auto q = input(), k = input(), v = input();
  const auto lower = c.causal
      ? torch::ones({c.T, c.T}, torch::TensorOptions(torch::kBool).device(target.device)).tril()
      : torch::Tensor();
  if (impl == Impl::aten_sdpa && !attn::detail::kHasNativeAttention) {
    state.SkipWithError("at::scaled_dot_product_attention needs LibTorch >= 2.0");
    return;
  }
  auto options = attn::SDPAOptions().is_causal(c.causal);
  if (impl != Impl::attn_default) {
    options.need_weights(impl == Impl::ours_weights);
  }
  if (impl == Impl::ours_window) {
    options.window(kWindow);
  }
  const bool bias = impl == Impl::ours_bias || impl == Impl::ours_learned_bias;
  if (bias) {
    if (c.T > kLongestBias) {
      state.SkipWithError("ours_bias: a (B, H, T, T) mask beyond T = 2048 takes gigabytes");
      return;
    }
    options.attn_mask(torch::randn({c.B, kHeads, c.T, c.T}, target.options())
                          .requires_grad_(impl == Impl::ours_learned_bias && backward));
  }
  const bool fused = impl == Impl::ours || impl == Impl::ours_window || bias;
  if (fused && target.device.is_cpu()) {
    options.backend(attn::AttentionBackend::fused_cpu);
  }
  const auto forward = [&]() -> torch::Tensor {
    if (impl == Impl::naive) {
      return attn::bench::naive_attention(q, k, v, lower);
    }
    if (impl == Impl::aten_sdpa) {
      return attn::detail::native_attention(q, k, v, 0.0, c.causal, c10::nullopt);
    }
    return std::get<0>(attn::scaled_dot_product_attention(q, k, v, options));
  };
  const double flops = impl == Impl::ours_window ? windowed_attention_flops(c) : attention_flops(c);
  if (backward) {
    measure(state, 3.0 * flops, target, [&] { forward().sum().backward(); });
  } else {
    torch::NoGradGuard no_grad;
    measure(state, flops, target, [&] { benchmark::DoNotOptimize(forward()); });
  }
}

// Self-attention through each module; `backward` adds a backward pass.
void multi_head(benchmark::State& state, Impl impl, bool backward, const Target& target) {
  const auto c = read_case(state);
  torch::manual_seed(0);
  attn::MultiHeadAttention ours(attn::MultiHeadAttentionOptions(kEmbed, kHeads));
  torch::nn::MultiheadAttention builtin(torch::nn::MultiheadAttentionOptions(kEmbed, kHeads));
  NaiveMultiHeadAttention naive;
  ours->to(target.device, target.dtype);
  builtin->to(target.device, target.dtype);
  for (auto* linear : {&naive.w_q, &naive.w_k, &naive.w_v, &naive.w_o}) {
    (*linear)->to(target.device, target.dtype);
  }
  auto x = torch::randn({c.B, c.T, kEmbed}, target.options().requires_grad(backward));
  const auto x_seq_first = x.detach().transpose(0, 1).contiguous().requires_grad_(backward);
  const bool is_builtin = impl == Impl::builtin || impl == Impl::builtin_weights;
  // The built-in takes only an additive float mask; the naive code a 0/1 one.
  const auto lower = c.causal && (is_builtin || impl == Impl::naive)
      ? torch::ones({c.T, c.T}, torch::TensorOptions(torch::kBool).device(target.device)).tril()
      : torch::Tensor();
  const auto causal_bias = lower.defined() && is_builtin
      ? torch::zeros({c.T, c.T}, target.options())
            .masked_fill(~lower, -std::numeric_limits<float>::infinity())
      : torch::Tensor();

  const auto forward = [&]() -> torch::Tensor {
    switch (impl) {
      case Impl::ours:
      case Impl::ours_weights:
        return std::get<0>(ours(
            x, x, x,
            attn::MultiHeadAttentionForwardOptions().is_causal(c.causal).need_weights(
                impl == Impl::ours_weights)));
      case Impl::attn_default:
        return std::get<0>(
            ours(x, x, x, attn::MultiHeadAttentionForwardOptions().is_causal(c.causal)));
      case Impl::builtin:
      case Impl::builtin_weights:
        return std::get<0>(builtin(
            x_seq_first, x_seq_first, x_seq_first, torch::Tensor(), impl == Impl::builtin_weights,
            causal_bias));
      case Impl::naive: return naive.forward(x, lower);
      case Impl::aten_sdpa:
      case Impl::ours_window:
      case Impl::ours_bias:
      case Impl::ours_learned_bias: break; // attention cores, not modules
    }
    return {};
  };
  const double flops = (attention_flops(c) + projection_flops(c)) * (backward ? 3.0 : 1.0);
  if (backward) {
    measure(state, flops, target, [&] { forward().sum().backward(); });
  } else {
    torch::NoGradGuard no_grad;
    measure(state, flops, target, [&] { benchmark::DoNotOptimize(forward()); });
  }
}

// Incremental decoding after a prompt of T tokens: kDecodeSteps more tokens,
// one at a time, either through a KV cache (the prompt read once, then each
// token alone) or recomputing the causal forward over the whole prefix for
// every token. GFLOP/s counts the cached computation's FLOPs for both, so
// the rates compare as the times do.
constexpr int64_t kDecodeSteps = 16;

void decode(benchmark::State& state, bool cached) {
  torch::NoGradGuard no_grad;
  const auto c = read_case(state);
  torch::manual_seed(0);
  attn::MultiHeadAttention mha(attn::MultiHeadAttentionOptions(kEmbed, kHeads));
  mha->eval();
  const auto x = torch::randn({c.B, c.T + kDecodeSteps, kEmbed});
  const auto causal = attn::MultiHeadAttentionForwardOptions().is_causal(true).need_weights(false);
  attn::KVCache cache(c.T + kDecodeSteps);
  double flops = attention_flops(c) + projection_flops(c); // the prompt
  for (int64_t t = 1; t <= kDecodeSteps; ++t) {
    flops += 4.0 * c.B * kHeads * (c.T + t) * kHeadDim + 4 * 2.0 * c.B * kEmbed * kEmbed;
  }
  measure(state, flops, {torch::kCPU, torch::kFloat}, [&] {
    if (cached) {
      cache.reset();
      const auto with_cache = attn::MultiHeadAttentionForwardOptions(causal).kv_cache(&cache);
      const auto prompt = x.narrow(1, 0, c.T);
      benchmark::DoNotOptimize(mha(prompt, prompt, prompt, with_cache));
      for (int64_t t = 0; t < kDecodeSteps; ++t) {
        const auto token = x.narrow(1, c.T + t, 1);
        benchmark::DoNotOptimize(mha(token, token, token, with_cache));
      }
    } else {
      for (int64_t t = 0; t <= kDecodeSteps; ++t) {
        const auto prefix = x.narrow(1, 0, c.T + t);
        benchmark::DoNotOptimize(mha(prefix, prefix, prefix, causal));
      }
    }
  });
}

void sgemm(benchmark::State& state) {
  torch::NoGradGuard no_grad;
  const int64_t n = state.range(0);
  const auto a = torch::randn({n, n}), b = torch::randn({n, n});
  auto out = torch::empty({n, n});
  measure(state, 2.0 * n * n * n, {torch::kCPU, torch::kFloat}, [&] { torch::mm_out(out, a, b); });
}

// T from 64 to 8192 with B = 1, plus B = 4 up to T = 1024; causal and not.
// At T = 64 the fused kernel runs its short heads' loops.
void shapes(benchmark::internal::Benchmark* b) {
  for (const int64_t causal : {0, 1}) {
    for (const int64_t T : {64, 128, 512, 1024, 2048, 4096, 8192}) {
      b->Args({T, 1, causal});
      if (T <= 1024) {
        b->Args({T, 4, causal});
      }
    }
  }
  b->ArgNames({"T", "B", "causal"})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(0.5);
}

// On CUDA: T from 512 to 8192, B = 1, causal and not.
void cuda_shapes(benchmark::internal::Benchmark* b) {
  for (const int64_t causal : {0, 1}) {
    for (const int64_t T : {512, 1024, 2048, 4096, 8192}) {
      b->Args({T, 1, causal});
    }
  }
  b->ArgNames({"T", "B", "causal"})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(0.2);
}

// The implementations of each group of a suite.
struct Suite {
  std::vector<Impl> core, core_backward, forward, backward;
};

// The core, the module forward and forward+backward, per implementation.
void register_suite(
    const Target& target,
    const Suite& suite,
    void (*apply_shapes)(benchmark::internal::Benchmark*)) {
  const auto name = [&](const char* group, Impl impl) {
    return target.prefix() + group + "/" + impl_name(impl);
  };
  for (const bool backward : {false, true}) {
    for (const Impl impl : backward ? suite.core_backward : suite.core) {
      benchmark::RegisterBenchmark(
          name(backward ? "core_forward_backward" : "core", impl).c_str(),
          [impl, backward, target](benchmark::State& s) {
            attention_core(s, impl, backward, target);
          })
          ->Apply(apply_shapes);
    }
    for (const Impl impl : backward ? suite.backward : suite.forward) {
      benchmark::RegisterBenchmark(
          name(backward ? "mha_forward_backward" : "mha_forward", impl).c_str(),
          [impl, backward, target](benchmark::State& s) { multi_head(s, impl, backward, target); })
          ->Apply(apply_shapes);
    }
  }
}

void register_cuda() {
  for (const auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    register_suite(
        {torch::kCUDA, dtype},
        {{Impl::ours, Impl::aten_sdpa, Impl::naive},
         {},
         {Impl::ours, Impl::ours_weights, Impl::builtin, Impl::builtin_weights},
         {Impl::ours, Impl::builtin}},
        cuda_shapes);
  }
}

void register_cpu() {
  const Target cpu{torch::kCPU, torch::kFloat};
  benchmark::RegisterBenchmark("sgemm", sgemm)
      ->Arg(1024)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  // attn_default: what a call with no options but causality runs.
  Suite float32{
      {Impl::ours, Impl::ours_weights, Impl::ours_window, Impl::ours_bias, Impl::naive,
       Impl::attn_default},
      {Impl::ours, Impl::ours_weights, Impl::ours_bias, Impl::ours_learned_bias,
       Impl::attn_default},
      {Impl::ours, Impl::ours_weights, Impl::builtin, Impl::builtin_weights, Impl::naive,
       Impl::attn_default},
      {Impl::ours, Impl::builtin, Impl::naive, Impl::attn_default}};
  if (attn::detail::kHasNativeAttention) {
    // LibTorch's own fused CPU attention beside attn's kernel and attn's
    // default choice; bfloat16 and float16 likewise.
    float32.core.insert(float32.core.end(), Impl::aten_sdpa);
    float32.core_backward.insert(float32.core_backward.end(), Impl::aten_sdpa);
    register_suite(
        {torch::kCPU, torch::kBFloat16},
        {{Impl::ours, Impl::ours_weights, Impl::ours_bias, Impl::aten_sdpa, Impl::attn_default},
         {Impl::ours, Impl::ours_weights, Impl::ours_bias, Impl::ours_learned_bias, Impl::aten_sdpa,
          Impl::attn_default},
         {Impl::ours, Impl::ours_weights, Impl::builtin, Impl::builtin_weights},
         {Impl::ours, Impl::builtin}},
        shapes);
    register_suite(
        {torch::kCPU, torch::kHalf},
        {{Impl::ours, Impl::ours_weights, Impl::ours_bias, Impl::aten_sdpa, Impl::attn_default},
         {Impl::ours, Impl::ours_weights, Impl::ours_bias, Impl::ours_learned_bias, Impl::aten_sdpa,
          Impl::attn_default},
         {},
         {}},
        shapes);
  }
  register_suite(cpu, float32, shapes);
  for (const bool cached : {true, false}) {
    benchmark::RegisterBenchmark(
        cached ? "decode/ours_kv_cache" : "decode/ours_recompute",
        [cached](benchmark::State& s) { decode(s, cached); })
        ->Args({512, 1, 1})
        ->Args({2048, 1, 1})
        ->ArgNames({"T", "B", "causal"})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->MinTime(0.5);
  }
  // Memory at a length where the built-in's weights alone would take 8 GiB.
  benchmark::RegisterBenchmark(
      "mha_forward_long/ours",
      [cpu](benchmark::State& s) { multi_head(s, Impl::ours, false, cpu); })
      ->Args({16384, 1, 0})
      ->Args({16384, 1, 1})
      ->ArgNames({"T", "B", "causal"})
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->Iterations(1);
}

} // namespace

int main(int argc, char** argv) {
  c10::SetCPUAllocator(&counting_allocator(), /*priority=*/1);
  const int threads = configure_threads();
  benchmark::AddCustomContext("threads", std::to_string(threads));
  benchmark::AddCustomContext("sgemm_1024_GFLOP/s", std::to_string(sgemm_gflops()));
  benchmark::AddCustomContext("libtorch", TORCH_VERSION);
  const char* device = std::getenv("ATTN_BENCH_DEVICE");
  if (device != nullptr && std::string(device) == "cuda") {
    if (!torch::cuda::is_available()) {
      std::fprintf(stderr, "ATTN_BENCH_DEVICE=cuda, but CUDA is not available to this LibTorch\n");
      return 2;
    }
    benchmark::AddCustomContext("device", "cuda");
    register_cuda();
  } else if (device == nullptr || std::string(device) == "cpu") {
    benchmark::AddCustomContext("device", "cpu");
    register_cpu();
  } else {
    std::fprintf(stderr, "ATTN_BENCH_DEVICE must be cpu or cuda, got '%s'\n", device);
    return 2;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
    return 1;
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
