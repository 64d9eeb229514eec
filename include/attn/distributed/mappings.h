#pragma once

/// The communication patterns of tensor parallelism, each a pair of
/// conjugate autograd functions (the backward of one is the forward of the
/// other), so that a parallel layer names every collective it makes:
///
/// | function               | forward               | backward              |
/// |------------------------|-----------------------|-----------------------|
/// | `copy_to_parallel`     | identity              | all-reduce (sum)      |
/// | `reduce_from_parallel` | all-reduce (sum)      | identity              |
/// | `scatter_to_parallel`  | keep this rank's part | all-gather            |
/// | `gather_from_parallel` | all-gather            | keep this rank's part |
///
/// Every rank of the group calls each of them (and their backward) in the
/// same order. A collective that fails or outlasts the group's timeout
/// throws a c10::Error naming it. With one rank they return their input.

#include <attn/distributed/process_group.h>

#include <torch/types.h>

namespace attn::distributed {

/// Identity; the gradient is summed over the ranks. Where a replicated
/// input enters a layer whose ranks each use it for their own part.
///
/// Example:
/// ```
/// auto x_parallel = attn::distributed::copy_to_parallel(x, group);
/// ```
torch::Tensor copy_to_parallel(const torch::Tensor& input, const Group& group);

/// The sum over the ranks of `input` (each rank's partial result);
/// the gradient passes unchanged to every rank.
///
/// Example:
/// ```
/// auto y = attn::distributed::reduce_from_parallel(partial_y, group);
/// ```
torch::Tensor reduce_from_parallel(const torch::Tensor& input, const Group& group);

/// This rank's part of `input` along `dim`, whose size must be divisible by
/// the number of ranks W: part r is `input.chunk(W, dim)[r]`. The gradient
/// is gathered from every rank.
///
/// Example:
/// ```
/// auto part = attn::distributed::scatter_to_parallel(x, 1, group);
/// ```
torch::Tensor scatter_to_parallel(const torch::Tensor& input, int64_t dim, const Group& group);

/// The parts of every rank concatenated along `dim`, in rank order (every
/// rank's part shaped alike); the gradient keeps this rank's part.
///
/// Example:
/// ```
/// auto whole = attn::distributed::gather_from_parallel(part, 1, group);
/// ```
torch::Tensor gather_from_parallel(const torch::Tensor& input, int64_t dim, const Group& group);

/// The collectives (and point-to-point sends, each counted as one) this
/// process has made through attn::distributed since the last
/// `reset_communication_count()`, and the bytes it contributed to them (an
/// all-reduce's whole tensor, an all-gather's own part, a send's message):
/// what a layer communicates, for docs/DISTRIBUTED.md's model of the
/// network time.
struct CommunicationCount {
  int64_t collectives = 0;
  int64_t bytes = 0;
};

/// Example:
/// ```
/// attn::distributed::reset_communication_count();
/// mha(x, x, x);
/// auto sent = attn::distributed::communication_count().bytes;
/// ```
CommunicationCount communication_count();
/// Sets the count to zero.
void reset_communication_count();

} // namespace attn::distributed
