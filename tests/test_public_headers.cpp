// Built without the precompiled torch header, and including attn first: the
// public headers must bring in everything they use.
#include <attn/attn.h>

#include <gtest/gtest.h>

namespace {

TEST(PublicHeaders, CompileOnTheirOwn) {
  const attn::MultiHeadAttentionOptions options(8, 2);
  EXPECT_EQ(options.kdim(), 8);
  EXPECT_EQ(options.vdim(), 8);
  EXPECT_TRUE(options.batch_first());
  EXPECT_FALSE(options.num_kv_heads().has_value()); // = num_heads
}

} // namespace
