#pragma once

// The instruction-set layer of the CPU kernels: the one probe of what this
// processor and its operating system can run, and the one table of the
// loops attn compiles for each x86 instruction set (micro-tiles, short-head
// loops, row operations). Every kernel asks here; nothing else probes the
// CPU. The probe reads CPUID and XGETBV itself, so that every compiler
// (GCC, Clang) sees the same processor and the backend rules agree.

#include <cstdint>

namespace attn::detail {

struct MicroTiles;
struct Bf16MicroTiles;
struct ShortHeadsLoops;
struct DropoutRow;

// Who designed the processor (CPUID leaf 0's vendor string): the same
// instruction runs at different rates on their cores.
enum class CpuVendor { other, intel, amd };

// What the processor has and the operating system saves across context
// switches (a set whose registers the OS does not save counts as absent).
struct CpuFeatures {
  CpuVendor vendor = CpuVendor::other;
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512_bf16 = false;
  bool avx512_fp16 = false;
  // AMX tiles with bfloat16 products. Linux grants a process the tile state
  // only on request (arch_prctl(ARCH_REQ_XCOMP_PERM)); this says what the
  // processor has.
  bool amx_bf16 = false;
};

// This machine's, probed once. All false off x86.
const CpuFeatures& cpu_features();

// The instruction sets attn compiles loops for, narrowest first.
enum class InstructionSet { avx2, avx512 };

// "AVX2", "AVX-512".
const char* instruction_set_name(InstructionSet set);

// Row operations on floats (row_ops.h): the largest of x[0..n), and
// x[j] = exp(x[j] - shift) in place with the sum of the results.
using RowMaxFn = float (*)(const float* x, int64_t n);
using ExpShiftedSumFn = float (*)(float* x, int64_t n, float shift);
// x[j] = cap·tanh(x[j] / cap), slopes[j] its derivative where not null.
using SoftcapFn = void (*)(float* x, int64_t n, float cap, float* slopes);

// Dropout's row operations on floats (dropout.h): drop_row and
// dropout_softmax_backward_row.
struct DropoutLoops {
  void (*drop_row)(float* x, int64_t n, const DropoutRow& row);
  void (*softmax_backward_row)(
      float* p,
      float* ds,
      int64_t n,
      float delta,
      float keep_scale,
      const DropoutRow& row);
};

// Everything compiled for one instruction set.
struct IsaLoops {
  InstructionSet set;
  const MicroTiles* micro_tiles;      // micro_tile.h
  const ShortHeadsLoops* short_heads; // short_heads_loops.h; null where not compiled
  RowMaxFn row_max;
  ExpShiftedSumFn exp_shifted_sum;
  SoftcapFn softcap;
  const DropoutLoops* dropout; // null where not compiled
};

// The loops of `set`, or null where this build did not compile them or
// this CPU cannot run them (AVX2 needs FMA too).
const IsaLoops* isa_loops(InstructionSet set);

// The widest set this CPU runs, or null.
const IsaLoops* widest_isa_loops();

// Whether this process may use AMX tiles: the CPU has AMX-BF16 and Linux
// granted the tile state (arch_prctl(ARCH_REQ_XCOMP_PERM), asked once for
// the whole process). False elsewhere.
bool amx_tiles_granted();

// The bfloat16 products (micro_tile.h) where this build compiled them and
// this CPU runs them (AVX512-BF16 and the OS's AVX-512 state), else null.
const Bf16MicroTiles* bf16_micro_tiles();

// While alive, the calling thread's float arithmetic treats subnormal
// inputs and results as zero (x86: MXCSR's FTZ and DAZ; elsewhere
// nothing), then returns to what it was. A kernel's probabilities below
// 2^-126 (ALiBi's far keys) made its products' every FMA on them take a
// microcode assist: BLOOM's causal layer at T = 1024 trained 1.22x slower
// than without ALiBi, 1.07x with them flushed.
class ScopedSubnormalsAsZero {
 public:
  ScopedSubnormalsAsZero();
  ~ScopedSubnormalsAsZero();
  ScopedSubnormalsAsZero(const ScopedSubnormalsAsZero&) = delete;
  ScopedSubnormalsAsZero& operator=(const ScopedSubnormalsAsZero&) = delete;

 private:
  unsigned int saved_ = 0;
};

} // namespace attn::detail
