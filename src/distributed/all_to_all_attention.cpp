#include "distributed/context_parallel_inputs.h"

#include <torch/torch.h>

namespace attn::distributed::detail {

torch::Tensor all_to_all_attention_of(
    const ContextParallelInputs& /*inputs*/,
    const Group& /*group*/) {
  TORCH_CHECK(false, "attn::distributed::ring_attention: the all_to_all strategy is not built yet");
  return {};
}

} // namespace attn::distributed::detail
