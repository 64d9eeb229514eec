#pragma once

// The instruction-set layer of the CPU kernels: the one probe of what this
// processor and its operating system can run, the levels of instructions
// it grants (CpuLevel), and the one table of the loops attn compiles for
// each x86 instruction set (micro-tiles, short-head loops, row
// operations). A call's plan takes its loops from here (cpu_loops) and
// hands them to the kernels; nothing else probes the CPU. The probe reads CPUID and XGETBV itself,
// so that every compiler (GCC, Clang) sees the same processor and the backend rules agree.

#include <cstdint>
#include <vector>

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

// How far up x86's instruction sets attn's CPU kernels reach, each level
// adding to the one below: portable C++ and the BLAS's products (every
// CPU); AVX2 with FMA; AVX-512; AVX512-BF16's bfloat16 products; AMX's
// tiles. A call's plan runs one (kernel_plan.h, cpu_loops below); the
// backend rules read it too.
enum class CpuLevel { portable, avx2, avx512, avx512_bf16, amx };

// "portable", "avx2", "avx512", "avx512_bf16", "amx": the names that
// ATTN_CPU_CAPABILITY takes.
const char* cpu_level_name(CpuLevel level);

// The levels this CPU runs (its flags and the operating system's grant of
// AMX's tiles, whichever compiler built attn), narrowest first, portable
// always; none above the one ATTN_CPU_CAPABILITY names where the
// environment sets it (read once, as if the CPU had no more). An unknown
// name is a c10::Error naming the known ones.
const std::vector<CpuLevel>& cpu_levels();

// The widest of cpu_levels(): what a call runs unless it asks for less.
CpuLevel widest_cpu_level();

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

// The loops of one CpuLevel, as a call's plan hands them to the kernels
// (kernel_plan.h): what every product, row operation and loop of the call
// runs on. Nothing else chooses loops.
struct CpuLoops {
  CpuLevel level = CpuLevel::portable;
  // AVX2's or AVX-512's loops; null: the BLAS's products and portable C++.
  const IsaLoops* isa = nullptr;
  // AVX512-BF16's bfloat16 micro-tiles and rounding; null: none.
  const Bf16MicroTiles* bf16 = nullptr;
  // Whether AMX's tiles compute the bfloat16 products.
  bool amx = false;
  // Whether these bfloat16 products outrun the float loops: AMX's tiles,
  // or AVX512-BF16 on AMD's cores (tile_product.h,
  // bf16_products_outrun_float).
  bool bf16_outruns_float = false;
  // Whether float16 rows widen and round in vector registers (AVX-512, or
  // AVX2 with F16C).
  bool half_rows_in_registers = false;
};

// The loops of `level` that this build compiled: a build without AMX's
// products, say, has none at level amx. `level` must be one of
// cpu_levels() (an internal error otherwise).
CpuLoops cpu_loops(CpuLevel level);

// Whether this process may use AMX tiles: the CPU has AMX-BF16 and Linux
// granted the tile state (arch_prctl(ARCH_REQ_XCOMP_PERM), asked once for
// the whole process). False elsewhere.
bool amx_tiles_granted();

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
