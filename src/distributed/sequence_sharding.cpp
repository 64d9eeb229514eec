#include <attn/distributed/context_parallel.h>
#include <attn/distributed/mappings.h>

#include <torch/torch.h>

#include <algorithm>
#include <ostream>

namespace attn::distributed {

std::ostream& operator<<(std::ostream& stream, SequenceLayout layout) {
  return stream << (layout == SequenceLayout::zigzag ? "zigzag" : "contiguous");
}

std::ostream& operator<<(std::ostream& stream, ContextParallelStrategy strategy) {
  return stream << (strategy == ContextParallelStrategy::ring ? "ring" : "all_to_all");
}

namespace {

// Chunks per rank: the zigzag layout gives each rank two.
int64_t chunks_per_rank(SequenceLayout layout) {
  return layout == SequenceLayout::zigzag ? 2 : 1;
}

} // namespace

SequenceSharding::SequenceSharding(int64_t length, int64_t world_size, SequenceLayout layout)
    : length_(length), world_size_(world_size), layout_(layout) {
  TORCH_CHECK(
      length >= 1,
      "attn::distributed::SequenceSharding: the sequence length must be at least 1, got ", length);
  TORCH_CHECK(
      world_size >= 1,
      "attn::distributed::SequenceSharding: the world size must be at least 1, got ", world_size);
}

int64_t SequenceSharding::local_length() const {
  const int64_t chunks = world_size_ * chunks_per_rank(layout_);
  const int64_t chunk_length = (length_ + chunks - 1) / chunks;
  return chunk_length * chunks_per_rank(layout_);
}

int64_t SequenceSharding::padded_length() const {
  return local_length() * world_size_;
}

std::vector<SequenceSharding::Segment> SequenceSharding::segments(int64_t rank) const {
  TORCH_CHECK(
      rank >= 0 && rank < world_size_, "attn::distributed::SequenceSharding: rank must be in [0, ",
      world_size_, "), got ", rank);
  const int64_t chunk = local_length() / chunks_per_rank(layout_);
  if (layout_ == SequenceLayout::contiguous) {
    return {{rank * chunk, chunk}};
  }
  return {{rank * chunk, chunk}, {(2 * world_size_ - 1 - rank) * chunk, chunk}};
}

int64_t SequenceSharding::rows_inside(const Segment& segment) const {
  return std::clamp<int64_t>(length_ - segment.start, 0, segment.length);
}

torch::Tensor SequenceSharding::padded(const torch::Tensor& whole, int64_t dim) const {
  TORCH_CHECK(
      whole.defined(), "attn::distributed::SequenceSharding::shard: the tensor is undefined");
  TORCH_CHECK(
      whole.size(dim) == length_, "attn::distributed::SequenceSharding::shard: size ",
      whole.size(dim), " of dimension ", dim, " must be the sequence length ", length_);
  if (padded_length() == length_) {
    return whole;
  }
  auto padding_sizes = whole.sizes().vec();
  padding_sizes[dim] = padded_length() - length_;
  return torch::cat({whole, torch::zeros(padding_sizes, whole.options())}, dim);
}

torch::Tensor SequenceSharding::rows_of(const torch::Tensor& padded, int64_t dim, int64_t rank)
    const {
  std::vector<torch::Tensor> pieces;
  for (const auto& segment : segments(rank)) {
    pieces.push_back(padded.narrow(dim, segment.start, segment.length));
  }
  return pieces.size() == 1 ? pieces[0] : torch::cat(pieces, dim);
}

torch::Tensor SequenceSharding::shard(const torch::Tensor& whole, int64_t dim, int64_t rank) const {
  TORCH_CHECK(
      whole.defined(), "attn::distributed::SequenceSharding::shard: the tensor is undefined");
  dim = c10::maybe_wrap_dim(dim, whole.dim());
  segments(rank); // checks the rank before any copy
  return rows_of(padded(whole, dim), dim, rank);
}

std::vector<torch::Tensor> SequenceSharding::shard_all(const torch::Tensor& whole, int64_t dim)
    const {
  TORCH_CHECK(
      whole.defined(), "attn::distributed::SequenceSharding::shard: the tensor is undefined");
  dim = c10::maybe_wrap_dim(dim, whole.dim());
  const auto padded_whole = padded(whole, dim);
  std::vector<torch::Tensor> parts;
  parts.reserve(world_size_);
  for (int64_t rank = 0; rank < world_size_; ++rank) {
    parts.push_back(rows_of(padded_whole, dim, rank));
  }
  return parts;
}

torch::Tensor SequenceSharding::unshard(const std::vector<torch::Tensor>& parts, int64_t dim)
    const {
  TORCH_CHECK(
      static_cast<int64_t>(parts.size()) == world_size_,
      "attn::distributed::SequenceSharding::unshard: expected the parts of ", world_size_,
      " ranks, got ", parts.size());
  // The pieces in sequence order: piece p of the padded sequence, found in
  // the part of the rank that holds it.
  const int64_t chunk = local_length() / chunks_per_rank(layout_);
  std::vector<torch::Tensor> pieces(world_size_ * chunks_per_rank(layout_));
  for (int64_t rank = 0; rank < world_size_; ++rank) {
    const auto& part = parts[rank];
    TORCH_CHECK(
        part.defined() && part.dim() > 0, "attn::distributed::SequenceSharding::unshard: part ",
        rank, " is undefined or a scalar");
    const int64_t part_dim = c10::maybe_wrap_dim(dim, part.dim());
    TORCH_CHECK(
        part.size(part_dim) == local_length(),
        "attn::distributed::SequenceSharding::unshard: size ", part.size(part_dim),
        " of dimension ", part_dim, " of part ", rank, " must be the local length ",
        local_length());
    int64_t row = 0;
    for (const auto& segment : segments(rank)) {
      pieces[segment.start / chunk] = part.narrow(part_dim, row, segment.length);
      row += segment.length;
    }
  }
  const int64_t whole_dim = c10::maybe_wrap_dim(dim, parts[0].dim());
  return torch::cat(pieces, whole_dim).narrow(whole_dim, 0, length_);
}

torch::Tensor gather_sequence(
    const torch::Tensor& part,
    int64_t dim,
    const SequenceSharding& sharding,
    const Group& group) {
  TORCH_CHECK(part.defined(), "attn::distributed::gather_sequence: the tensor is undefined");
  TORCH_CHECK(
      sharding.world_size() == group.size(),
      "attn::distributed::gather_sequence: the sharding is for ", sharding.world_size(),
      " ranks, the group has ", group.size());
  dim = c10::maybe_wrap_dim(dim, part.dim());
  const auto parts = gather_from_parallel(part, dim, group).chunk(group.size(), dim);
  return sharding.unshard(parts, dim);
}

} // namespace attn::distributed
