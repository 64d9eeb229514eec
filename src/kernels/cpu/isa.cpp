#include "kernels/cpu/isa.h"

#include "kernels/cpu/amx_products.h"
#include "kernels/cpu/micro_tile.h"
#include "kernels/cpu/vector_loops.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#define ATTN_X86 1
#include <cpuid.h>
#include <xmmintrin.h>
#endif

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace attn::detail {
namespace {

#ifdef ATTN_X86

struct CpuidLeaf {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};

// Leaf `leaf`, sub-leaf `sub`; zeros where the CPU has no such leaf.
CpuidLeaf cpuid(unsigned leaf, unsigned sub) {
  CpuidLeaf r;
  // (GCC and newer Clang declare the maximum leaf unsigned, Clang 14 int.)
  const unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < leaf || __get_cpuid_count(leaf, sub, &r.eax, &r.ebx, &r.ecx, &r.edx) == 0) {
    return {};
  }
  return r;
}

bool bit(unsigned word, int index) {
  return ((word >> index) & 1u) != 0;
}

// XCR0, the register state the operating system saves (XGETBV; only where
// CPUID says the OS enabled it).
uint64_t saved_register_state(const CpuidLeaf& leaf1) {
  constexpr int kOsxsave = 27;
  if (!bit(leaf1.ecx, kOsxsave)) {
    return 0;
  }
  unsigned low = 0, high = 0;
  __asm__ volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
  return (uint64_t{high} << 32) | low;
}

// "GenuineIntel" or "AuthenticAMD" in EBX, EDX, ECX of leaf 0.
CpuVendor vendor() {
  const CpuidLeaf leaf0 = cpuid(0, 0);
  char name[13] = {};
  std::memcpy(name, &leaf0.ebx, 4);
  std::memcpy(name + 4, &leaf0.edx, 4);
  std::memcpy(name + 8, &leaf0.ecx, 4);
  const std::string id(name);
  return id == "GenuineIntel" ? CpuVendor::intel
      : id == "AuthenticAMD"  ? CpuVendor::amd
                              : CpuVendor::other;
}

CpuFeatures probe() {
  // Bit positions: Intel SDM vol. 2A, CPUID; XCR0 vol. 1, 13.3.
  const CpuidLeaf leaf1 = cpuid(1, 0), leaf7 = cpuid(7, 0), leaf7_1 = cpuid(7, 1);
  const uint64_t xcr0 = saved_register_state(leaf1);
  constexpr uint64_t kYmmState = 0x6;      // SSE and AVX registers
  constexpr uint64_t kZmmState = 0xe6;     // and the opmask and upper ZMM registers
  constexpr uint64_t kTileState = 0x60000; // AMX tile configuration and data
  const bool ymm = (xcr0 & kYmmState) == kYmmState;
  const bool zmm = (xcr0 & kZmmState) == kZmmState;
  CpuFeatures f;
  f.vendor = vendor();
  f.fma = ymm && bit(leaf1.ecx, 12);
  f.f16c = ymm && bit(leaf1.ecx, 29);
  f.avx2 = ymm && bit(leaf7.ebx, 5);
  f.avx512f = zmm && bit(leaf7.ebx, 16);
  f.avx512bw = zmm && bit(leaf7.ebx, 30);
  f.avx512vl = zmm && bit(leaf7.ebx, 31);
  f.avx512_fp16 = zmm && bit(leaf7.edx, 23);
  f.avx512_bf16 = zmm && bit(leaf7_1.eax, 5);
  f.amx_bf16 = (xcr0 & kTileState) == kTileState && bit(leaf7.edx, 22) && bit(leaf7.edx, 24);
  return f;
}

#else

CpuFeatures probe() {
  return {};
}

#endif

bool cpu_runs(InstructionSet set) {
  const auto& cpu = cpu_features();
  switch (set) {
    case InstructionSet::avx512: return cpu.avx512f;
    case InstructionSet::avx2: return cpu.avx2 && cpu.fma;
  }
  return false;
}

// The set's loops, as its files compiled them; null without micro-tiles.
const IsaLoops* compiled_loops(InstructionSet set) {
  const auto table = [](InstructionSet s, const MicroTiles* tiles, const VectorLoops* vector) {
    if (vector == nullptr) {
      return IsaLoops{s, tiles, nullptr, nullptr, nullptr, nullptr, nullptr};
    }
    return IsaLoops{
        s,
        tiles,
        &vector->short_heads,
        vector->row_max,
        vector->exp_shifted_sum,
        vector->softcap,
        &vector->dropout};
  };
  static const IsaLoops avx512 = table(
      InstructionSet::avx512, avx512_micro_tiles(), avx512_vector_loops());
  static const IsaLoops avx2 = table(InstructionSet::avx2, avx2_micro_tiles(), avx2_vector_loops());
  const IsaLoops& loops = set == InstructionSet::avx512 ? avx512 : avx2;
  return loops.micro_tiles == nullptr ? nullptr : &loops;
}

} // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = probe();
  return features;
}

const char* instruction_set_name(InstructionSet set) {
  switch (set) {
    case InstructionSet::avx512: return "AVX-512";
    case InstructionSet::avx2: return "AVX2";
  }
  return "unknown";
}

const IsaLoops* isa_loops(InstructionSet set) {
  return cpu_runs(set) ? compiled_loops(set) : nullptr;
}

#ifdef ATTN_X86
namespace {
constexpr unsigned int kFlushToZero = 0x8000;      // MXCSR.FTZ
constexpr unsigned int kDenormalsAreZero = 0x0040; // MXCSR.DAZ
} // namespace

ScopedSubnormalsAsZero::ScopedSubnormalsAsZero() : saved_(_mm_getcsr()) {
  _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero);
}

ScopedSubnormalsAsZero::~ScopedSubnormalsAsZero() {
  _mm_setcsr(saved_);
}
#else
ScopedSubnormalsAsZero::ScopedSubnormalsAsZero() = default;
ScopedSubnormalsAsZero::~ScopedSubnormalsAsZero() = default;
#endif

bool amx_tiles_granted() {
  static const bool granted = [] {
    if (!cpu_features().amx_bf16) {
      return false;
    }
#if defined(__linux__) && defined(__x86_64__)
    constexpr long kRequestComponentPermission = 0x1023; // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;                       // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestComponentPermission, kTileData) == 0;
#else
    return false;
#endif
  }();
  return granted;
}

namespace {

constexpr CpuLevel kCpuLevels[] = {
    CpuLevel::portable, CpuLevel::avx2, CpuLevel::avx512, CpuLevel::avx512_bf16, CpuLevel::amx};

// Whether the CPU (and the OS) runs `level`'s instructions.
bool cpu_has(CpuLevel level) {
  const auto& cpu = cpu_features();
  switch (level) {
    case CpuLevel::portable: return true;
    case CpuLevel::avx2: return cpu.avx2 && cpu.fma;
    case CpuLevel::avx512: return cpu.avx512f;
    case CpuLevel::avx512_bf16: return cpu.avx512_bf16;
    case CpuLevel::amx: return amx_tiles_granted();
  }
  return false;
}

// The level ATTN_CPU_CAPABILITY names; the widest where it is unset.
CpuLevel capability_from_environment() {
  const char* name = std::getenv("ATTN_CPU_CAPABILITY");
  if (name == nullptr || *name == '\0') {
    return CpuLevel::amx;
  }
  const auto* named = std::find_if(std::begin(kCpuLevels), std::end(kCpuLevels), [&](CpuLevel l) {
    return std::strcmp(name, cpu_level_name(l)) == 0;
  });
  TORCH_CHECK(
      named != std::end(kCpuLevels),
      "ATTN_CPU_CAPABILITY must be one of portable, avx2, avx512, avx512_bf16, amx, got '", name,
      "'");
  return *named;
}

} // namespace

const char* cpu_level_name(CpuLevel level) {
  switch (level) {
    case CpuLevel::portable: return "portable";
    case CpuLevel::avx2: return "avx2";
    case CpuLevel::avx512: return "avx512";
    case CpuLevel::avx512_bf16: return "avx512_bf16";
    case CpuLevel::amx: return "amx";
  }
  return "unknown";
}

const std::vector<CpuLevel>& cpu_levels() {
  static const std::vector<CpuLevel> levels = [] {
    const CpuLevel cap = capability_from_environment();
    std::vector<CpuLevel> runs;
    for (const auto level : kCpuLevels) {
      if (level > cap || !cpu_has(level)) {
        break; // each level adds to those below it
      }
      runs.push_back(level);
    }
    return runs;
  }();
  return levels;
}

CpuLevel widest_cpu_level() {
  return cpu_levels().back();
}

CpuLoops cpu_loops(CpuLevel level) {
  const auto& levels = cpu_levels();
  TORCH_INTERNAL_ASSERT(
      std::find(levels.begin(), levels.end(), level) != levels.end(), "the CPU level ",
      cpu_level_name(level), " is beyond this CPU's");
  CpuLoops loops;
  loops.level = level;
  if (level >= CpuLevel::avx2) {
    loops.isa = isa_loops(
        level >= CpuLevel::avx512 ? InstructionSet::avx512 : InstructionSet::avx2);
  }
  if (level >= CpuLevel::avx512_bf16) {
    loops.bf16 = avx512_bf16_micro_tiles();
  }
  loops.amx = level == CpuLevel::amx && amx_products_run();
  loops.bf16_outruns_float = loops.amx ||
      (loops.bf16 != nullptr && cpu_features().vendor == CpuVendor::amd);
  loops.half_rows_in_registers = loops.isa != nullptr &&
      (loops.isa->set == InstructionSet::avx512 || cpu_features().f16c);
  return loops;
}

} // namespace attn::detail

#undef ATTN_X86
