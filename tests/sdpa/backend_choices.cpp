// attn_backend_choices: the backend attn::select_backend picks for each of a
// fixed grid of requests, one line per request. Built by every compiler
// that builds attn (ctest runs the GCC build; scripts/fuzz.sh builds it with
// clang and compares the two outputs), so that a compiler that saw the CPU
// differently would show as a differing line.

#include <attn/functional.h>

#include <torch/torch.h>

#include <cstdint>
#include <iostream>

namespace {

struct Request {
  torch::ScalarType dtype;
  int64_t heads, L, S, D;
  bool causal, weights, grad, masked;
};

void print_choice(const Request& r) {
  const auto make = [&](int64_t T) {
    return torch::empty({1, r.heads, T, r.D}, r.dtype).requires_grad_(r.grad);
  };
  const auto q = make(r.L), k = make(r.S), v = make(r.S);
  auto options = attn::SDPAOptions().is_causal(r.causal).need_weights(r.weights);
  if (r.masked) {
    options.attn_mask(torch::ones({r.L, r.S}, torch::kBool));
  }
  std::cout << r.dtype << " heads=" << r.heads << " L=" << r.L << " S=" << r.S << " D=" << r.D
            << (r.causal ? " causal" : "") << (r.weights ? " weights" : "")
            << (r.grad ? " grad" : "") << (r.masked ? " mask" : "") << ": "
            << attn::select_backend(q, k, v, options) << "\n";
}

} // namespace

int main() {
  for (const auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16, torch::kHalf}) {
    for (const int64_t T : {16, 64, 128, 512, 2048}) {
      for (const int64_t heads : {2, 32}) {
        for (const int64_t D : {16, 64}) {
          for (int flags = 0; flags < 16; ++flags) {
            print_choice(
                {dtype, heads, T, T, D, (flags & 1) != 0, (flags & 2) != 0, (flags & 4) != 0,
                 (flags & 8) != 0});
          }
        }
      }
    }
  }
  return 0;
}
