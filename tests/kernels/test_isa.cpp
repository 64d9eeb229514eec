// The instruction-set layer (src/kernels/cpu/isa.*): its probe of the CPU
// against the operating system's own list of the CPU's features, and its
// table against what the probe found.

#include "kernels/cpu/amx_products.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/micro_tile.h"
#include "test_support.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

namespace {

using attn::testing::linux_cpu_flags;

TEST(CpuFeatures, AgreeWithTheFlagsLinuxReads) {
  const auto flags = linux_cpu_flags();
  if (flags.empty()) {
    GTEST_SKIP() << "no /proc/cpuinfo with a flags line on this system to compare with";
  }
  const auto has = [&](const char* flag) { return flags.count(flag) > 0; };
  const auto& cpu = attn::detail::cpu_features();
  EXPECT_EQ(cpu.avx2, has("avx2"));
  EXPECT_EQ(cpu.fma, has("fma"));
  EXPECT_EQ(cpu.f16c, has("f16c"));
  EXPECT_EQ(cpu.avx512f, has("avx512f"));
  EXPECT_EQ(cpu.avx512bw, has("avx512bw"));
  EXPECT_EQ(cpu.avx512vl, has("avx512vl"));
  EXPECT_EQ(cpu.avx512_bf16, has("avx512_bf16"));
  EXPECT_EQ(cpu.avx512_fp16, has("avx512_fp16"));
  EXPECT_EQ(cpu.amx_bf16, has("amx_bf16") && has("amx_tile"));
  const std::string vendor = attn::testing::linux_cpuinfo_field("vendor_id");
  using attn::detail::CpuVendor;
  EXPECT_EQ(
      cpu.vendor,
      vendor == "GenuineIntel"       ? CpuVendor::intel
          : vendor == "AuthenticAMD" ? CpuVendor::amd
                                     : CpuVendor::other)
      << "vendor_id: " << vendor;
}

TEST(IsaLoops, TheTableHoldsEverySetThisCpuRunsAndNoOther) {
  using attn::detail::InstructionSet;
  const auto& cpu = attn::detail::cpu_features();
#if defined(__x86_64__) || defined(__i386__)
  EXPECT_EQ(attn::detail::isa_loops(InstructionSet::avx512) != nullptr, cpu.avx512f);
  EXPECT_EQ(attn::detail::isa_loops(InstructionSet::avx2) != nullptr, cpu.avx2 && cpu.fma);
#else
  EXPECT_EQ(attn::detail::isa_loops(InstructionSet::avx512), nullptr);
  EXPECT_EQ(attn::detail::isa_loops(InstructionSet::avx2), nullptr);
#endif
}

// The levels: portable first, each adding to the one below, as the CPU's
// flags say, and none above ATTN_CPU_CAPABILITY's where it is set (ctest
// runs this once more under ATTN_CPU_CAPABILITY=avx2:
// cpu_capability.environment_caps_the_levels). Each level's loops are
// those of its instruction set.
TEST(CpuLevels, EachLevelAddsWhatTheCpuHasUpToTheEnvironmentsCap) {
  using attn::detail::CpuLevel;
  const auto& cpu = attn::detail::cpu_features();
  const auto& levels = attn::detail::cpu_levels();
  ASSERT_FALSE(levels.empty());
  EXPECT_EQ(levels.front(), CpuLevel::portable);
  EXPECT_TRUE(std::is_sorted(levels.begin(), levels.end()));
  // The names ATTN_CPU_CAPABILITY takes, narrowest first (docs/BACKENDS.md).
  const std::vector<std::string> names{"portable", "avx2", "avx512", "avx512_bf16", "amx"};
  const char* cap = std::getenv("ATTN_CPU_CAPABILITY");
  const auto cap_index = cap == nullptr
      ? names.size() - 1
      : static_cast<size_t>(std::find(names.begin(), names.end(), cap) - names.begin());
  const bool avx2 = cpu.avx2 && cpu.fma, avx512 = avx2 && cpu.avx512f;
  const bool bf16 = avx512 && cpu.avx512_bf16, amx = bf16 && attn::detail::amx_tiles_granted();
  const bool by_flags[] = {true, avx2, avx512, bf16, amx};
  for (size_t l = 0; l < names.size(); ++l) {
    const auto level = static_cast<CpuLevel>(l);
    SCOPED_TRACE(names[l]);
    EXPECT_EQ(attn::detail::cpu_level_name(level), names[l]);
    const bool listed = std::find(levels.begin(), levels.end(), level) != levels.end();
    EXPECT_EQ(listed, by_flags[l] && l <= cap_index);
    if (!listed) {
      continue;
    }
    const auto loops = attn::detail::cpu_loops(level);
    EXPECT_EQ(loops.level, level);
    if (level == CpuLevel::portable) {
      EXPECT_EQ(loops.isa, nullptr);
    } else if (loops.isa != nullptr) { // where this build compiled the set
      EXPECT_EQ(
          loops.isa->set,
          level == CpuLevel::avx2 ? attn::detail::InstructionSet::avx2
                                  : attn::detail::InstructionSet::avx512);
    }
    EXPECT_EQ(
        loops.bf16,
        level >= CpuLevel::avx512_bf16 ? attn::detail::avx512_bf16_micro_tiles() : nullptr);
    EXPECT_EQ(loops.amx, level == CpuLevel::amx && attn::detail::amx_products_run());
  }
}

// An unknown name in ATTN_CPU_CAPABILITY is an error naming the known ones
// (ctest sets one: cpu_capability.unknown_environment_name_is_an_error).
TEST(CpuLevelsOfAnUnknownName, AreAnErrorNamingTheKnownOnes) {
  const char* cap = std::getenv("ATTN_CPU_CAPABILITY");
  if (cap == nullptr || std::string(cap) != "avx3") {
    GTEST_SKIP() << "runs where ctest sets ATTN_CPU_CAPABILITY=avx3";
  }
  EXPECT_ATTN_ERROR(
      attn::detail::cpu_levels(),
      "ATTN_CPU_CAPABILITY must be one of portable, avx2, avx512, avx512_bf16, amx, got 'avx3'");
}

} // namespace
