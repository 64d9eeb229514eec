// Built without the precompiled torch header, and including attn's
// distributed headers first: they must bring in everything they use.
#include <attn/distributed/context_parallel.h>
#include <attn/distributed/context_parallel_multi_head_attention.h>
#include <attn/distributed/mappings.h>
#include <attn/distributed/process_group.h>
#include <attn/distributed/tensor_parallel_multi_head_attention.h>

#include <gtest/gtest.h>

namespace {

TEST(DistributedPublicHeaders, CompileOnTheirOwn) {
  const auto options = attn::distributed::InitOptions().backend("nccl");
  EXPECT_EQ(options.backend(), "nccl");
  EXPECT_EQ(options.timeout(), attn::distributed::kDefaultTimeout);
  const auto sharding = attn::distributed::SequenceSharding(10, 4);
  EXPECT_EQ(attn::distributed::ContextParallelOptions(sharding).sharding().local_length(), 4);
  EXPECT_TRUE(
      attn::distributed::ContextParallelForwardOptions(sharding).is_causal(true).is_causal());
}

} // namespace
