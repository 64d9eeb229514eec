// attn::select_device (src/runtime/device.cpp): the accepted requests and the
// errors for the rest.

#include "bad_input_catalogue.h"
#include "test_support.h"

#include <attn/device.h>

namespace {

TEST(SelectDevice, CpuIsAlwaysAvailable) {
  EXPECT_EQ(attn::select_device("cpu"), torch::Device(torch::kCPU));
}

TEST(SelectDevice, AutoPicksCudaExactlyWhenAvailable) {
  const auto device = attn::select_device("auto");
  EXPECT_EQ(device.is_cuda(), torch::cuda::is_available());
  EXPECT_TRUE(device.is_cuda() || device.is_cpu());
}

TEST(SelectDevice, UnknownRequestsNameTheAcceptedValues) {
  attn::testing::expect_catalogued_outcomes(attn::testing::unknown_device_cases());
}

TEST(SelectDevice, CudaWithoutCudaIsAClearError) {
  if (torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA is available here, so asking for it is not an error";
  }
  attn::testing::expect_catalogued_outcomes(attn::testing::unavailable_cuda_cases());
}

TEST(SelectDevice, CudaIndicesAreCheckedAgainstTheVisibleGpus) {
  ATTN_SKIP_IF_UNAVAILABLE(torch::Device(torch::kCUDA));
  const auto count = static_cast<int64_t>(torch::cuda::device_count());
  EXPECT_EQ(attn::select_device("cuda:0"), torch::Device(torch::kCUDA, 0));
  EXPECT_TRUE(attn::select_device("cuda").is_cuda());
  const auto past_the_end = "cuda:" + std::to_string(count);
  EXPECT_ATTN_ERROR(
      attn::select_device(past_the_end),
      "device '" + past_the_end + "' requested but only " + std::to_string(count) +
          " CUDA device(s) are visible");
}

} // namespace
