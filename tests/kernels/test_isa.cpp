// The instruction-set layer (src/kernels/cpu/isa.*): its probe of the CPU
// against the operating system's own list of the CPU's features, and its
// table against what the probe found.

#include "kernels/cpu/isa.h"
#include "test_support.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

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
  const auto* widest = attn::detail::widest_isa_loops();
  if (widest == nullptr) {
    EXPECT_FALSE(cpu.avx512f || (cpu.avx2 && cpu.fma));
    return;
  }
  EXPECT_EQ(widest->set, cpu.avx512f ? InstructionSet::avx512 : InstructionSet::avx2);
  EXPECT_NE(widest->micro_tiles, nullptr);
}

} // namespace
