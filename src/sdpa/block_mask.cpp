#include "sdpa/block_mask.h"

#include "kernels/cpu/mask_view.h"
#include "kernels/cpu/parallel.h"

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <exception>
#include <limits>
#include <utility>
#include <vector>

namespace attn {
namespace detail {
namespace {

constexpr const char* kBlockMaskCaller = "block_mask";

// KeyBand as a predicate: causal, and with a window the last `window` keys.
class BandNode final : public MaskPredicateNode {
 public:
  explicit BandNode(int64_t window) : band_{true, 0, window, std::numeric_limits<int64_t>::max()} {}

  uint8_t classify(const PairBlock& block) const override { return band_block_kind(band_, block); }

  void allows_row(int64_t /*b*/, int64_t /*h*/, int64_t i, int64_t j0, int64_t j1, uint8_t* out)
      const override {
    const int64_t begin = band_.begin(i), end = band_.end(i);
    for (int64_t j = j0; j < j1; ++j) {
      out[j - j0] = begin <= j && j < end ? 1 : 0;
    }
  }

  const KeyBand* band() const override { return &band_; }

 private:
  KeyBand band_;
};

// A (B, T) int64 copy of integer ids `(T)` or `(B, T)`, named `name`.
torch::Tensor id_rows(const torch::Tensor& ids, const char* name) {
  TORCH_CHECK(ids.defined(), "document_mask: ", name, " must be a defined tensor");
  TORCH_CHECK(
      ids.dim() == 1 || ids.dim() == 2, "document_mask: ", name, " must be (T) or (B, T), got ",
      ids.sizes());
  check_integers("document_mask", name, ids);
  // A copy: the caller may write to its ids after the mask is built.
  const auto rows = (ids.dim() == 1 ? ids.unsqueeze(0) : ids).to(torch::kCPU, torch::kLong).clone();
  const auto decreasing = rows.size(1) > 1
      ? (rows.narrow(1, 1, rows.size(1) - 1) < rows.narrow(1, 0, rows.size(1) - 1)).nonzero()
      : torch::empty({0, 2}, torch::kLong);
  TORCH_CHECK(
      decreasing.size(0) == 0, "document_mask: ", name,
      " must be nondecreasing along each row (each document's tokens together), got a decrease ",
      "at row ", decreasing.size(0) > 0 ? decreasing[0][0].item<int64_t>() : 0, ", position ",
      decreasing.size(0) > 0 ? decreasing[0][1].item<int64_t>() + 1 : 0);
  return rows.contiguous();
}

// Key bounds (L rows of [begin, end)) of two predicates combined into
// `into`: their intersection (`both`) or the smallest range holding both.
// Each stays nondecreasing at both ends.
void combine_bounds(int64_t* into, const int64_t* other, int64_t L, bool both) {
  for (int64_t i = 0; i < 2 * L; i += 2) {
    into[i] = both ? std::max(into[i], other[i]) : std::min(into[i], other[i]);
    into[i + 1] = both ? std::min(into[i + 1], other[i + 1]) : std::max(into[i + 1], other[i + 1]);
  }
}

// Same document: ids nondecreasing, so a block's queries hold the ids
// [first row's, last row's] and its keys likewise.
class DocumentNode final : public MaskPredicateNode {
 public:
  DocumentNode(torch::Tensor query_ids, torch::Tensor key_ids)
      : query_ids_(std::move(query_ids)), key_ids_(std::move(key_ids)) {
    TORCH_CHECK(
        query_ids_.size(0) == key_ids_.size(0), "document_mask: the query and key document ids ",
        "must have as many rows, got ", query_ids_.size(0), " and ", key_ids_.size(0));
  }

  uint8_t classify(const PairBlock& block) const override {
    const int64_t q_first = query_id(block.b, block.i0), q_last = query_id(block.b, block.i1 - 1);
    const int64_t k_first = key_id(block.b, block.j0), k_last = key_id(block.b, block.j1 - 1);
    if (q_last < k_first || k_last < q_first) {
      return kEmptyBlock;
    }
    return q_first == q_last && k_first == k_last ? kFullBlock : kPartialBlock;
  }

  void allows_row(int64_t b, int64_t /*h*/, int64_t i, int64_t j0, int64_t j1, uint8_t* out)
      const override {
    const int64_t own = query_id(b, i);
    const int64_t* keys = row_of(key_ids_, b);
    for (int64_t j = j0; j < j1; ++j) {
      out[j - j0] = keys[j] == own ? 1 : 0;
    }
  }

  void check_sizes(int64_t batch, int64_t L, int64_t S) const override {
    TORCH_CHECK(
        query_ids_.size(1) == L && key_ids_.size(1) == S, kBlockMaskCaller,
        ": the document ids hold ", query_ids_.size(1), " query and ", key_ids_.size(1),
        " key positions, but the mask is for ", L, " queries and ", S, " keys");
    TORCH_CHECK(
        query_ids_.size(0) == 1 || query_ids_.size(0) == batch, kBlockMaskCaller,
        ": the document ids have ", query_ids_.size(0), " rows, expected 1 or batch = ", batch);
  }

  bool depends_on_batch() const override { return query_ids_.size(0) > 1; }

  // Query i's keys are those of its id: ids nondecreasing, one run.
  bool key_bounds(int64_t b, int64_t L, int64_t S, int64_t* out) const override {
    const int64_t* keys = row_of(key_ids_, b);
    for (int64_t i = 0; i < L; ++i) {
      const auto [first, last] = std::equal_range(keys, keys + S, query_id(b, i));
      out[2 * i] = first - keys;
      out[2 * i + 1] = last - keys;
    }
    return true;
  }

 private:
  int64_t query_id(int64_t b, int64_t i) const { return row_of(query_ids_, b)[i]; }
  int64_t key_id(int64_t b, int64_t j) const { return row_of(key_ids_, b)[j]; }
  // Batch row b's ids (the one row where there is one).
  static const int64_t* row_of(const torch::Tensor& ids, int64_t b) {
    return ids.data_ptr<int64_t>() + (ids.size(0) == 1 ? 0 : b) * ids.size(1);
  }

  torch::Tensor query_ids_, key_ids_;
};

// Prefix-LM: the first prefix[b] keys, then causal.
class PrefixNode final : public MaskPredicateNode {
 public:
  explicit PrefixNode(torch::Tensor lengths) : lengths_(std::move(lengths)) {}

  uint8_t classify(const PairBlock& block) const override {
    const int64_t prefix = length(block.b);
    if (block.j1 <= prefix || block.j1 - 1 <= block.i0) {
      return kFullBlock;
    }
    return block.j0 >= prefix && block.j0 > block.i1 - 1 ? kEmptyBlock : kPartialBlock;
  }

  void allows_row(int64_t b, int64_t /*h*/, int64_t i, int64_t j0, int64_t j1, uint8_t* out)
      const override {
    const int64_t prefix = length(b);
    for (int64_t j = j0; j < j1; ++j) {
      out[j - j0] = j < prefix || j <= i ? 1 : 0;
    }
  }

  void check_sizes(int64_t batch, int64_t /*L*/, int64_t /*S*/) const override {
    TORCH_CHECK(
        lengths_.size(0) == 1 || lengths_.size(0) == batch, kBlockMaskCaller,
        ": prefix_lengths has ", lengths_.size(0), " entries, expected 1 or batch = ", batch);
  }

  bool depends_on_batch() const override { return lengths_.size(0) > 1; }

 private:
  int64_t length(int64_t b) const {
    return lengths_.data_ptr<int64_t>()[lengths_.size(0) == 1 ? 0 : b];
  }

  torch::Tensor lengths_;
};

// A user's predicate: every block it is asked about is tested pair by pair.
class FunctionNode final : public MaskPredicateNode {
 public:
  explicit FunctionNode(MaskPredicate::Function function) : function_(std::move(function)) {
    TORCH_CHECK(function_ != nullptr, "MaskPredicate: the function must not be empty");
  }

  uint8_t classify(const PairBlock& /*block*/) const override { return kPartialBlock; }

  void allows_row(int64_t b, int64_t h, int64_t i, int64_t j0, int64_t j1, uint8_t* out)
      const override {
    for (int64_t j = j0; j < j1; ++j) {
      out[j - j0] = function_(b, h, i, j) ? 1 : 0;
    }
  }

  bool depends_on_batch() const override { return true; }
  bool depends_on_heads() const override { return true; }

 private:
  MaskPredicate::Function function_;
};

// Both (conjunction) or either (disjunction) of two predicates.
class PairNode final : public MaskPredicateNode {
 public:
  PairNode(
      std::shared_ptr<const MaskPredicateNode> first,
      std::shared_ptr<const MaskPredicateNode> second,
      bool both)
      : first_(std::move(first)), second_(std::move(second)), both_(both) {}

  uint8_t classify(const PairBlock& block) const override {
    const uint8_t a = first_->classify(block), b = second_->classify(block);
    // Both: empty if either is, full if both are. Either: the converse.
    const uint8_t absorbing = both_ ? kEmptyBlock : kFullBlock;
    if (a == absorbing || b == absorbing) {
      return absorbing;
    }
    return a == b ? a : uint8_t{kPartialBlock};
  }

  void allows_row(int64_t b, int64_t h, int64_t i, int64_t j0, int64_t j1, uint8_t* out)
      const override {
    std::array<uint8_t, MaskBlocks::kCols> other{};
    first_->allows_row(b, h, i, j0, j1, out);
    second_->allows_row(b, h, i, j0, j1, other.data());
    for (int64_t j = 0; j < j1 - j0; ++j) {
      out[j] = both_ ? (out[j] & other[j]) : (out[j] | other[j]);
    }
  }

  void check_sizes(int64_t batch, int64_t L, int64_t S) const override {
    first_->check_sizes(batch, L, S);
    second_->check_sizes(batch, L, S);
  }

  bool depends_on_batch() const override {
    return first_->depends_on_batch() || second_->depends_on_batch();
  }
  bool depends_on_heads() const override {
    return first_->depends_on_heads() || second_->depends_on_heads();
  }

  // Both: the narrower of the bounds (either's where one has none);
  // either: the wider, where both have them.
  bool key_bounds(int64_t b, int64_t L, int64_t S, int64_t* out) const override {
    std::vector<int64_t> other(2 * L);
    const bool first = first_->key_bounds(b, L, S, out);
    const bool second = second_->key_bounds(b, L, S, other.data());
    if (!first || !second) {
      if (both_ && second) {
        std::copy(other.begin(), other.end(), out);
      }
      return both_ && (first || second);
    }
    combine_bounds(out, other.data(), L, both_);
    return true;
  }

  void add_conjuncts(std::vector<const MaskPredicateNode*>& into) const override {
    if (!both_) {
      into.push_back(this);
      return;
    }
    first_->add_conjuncts(into);
    second_->add_conjuncts(into);
  }

 private:
  std::shared_ptr<const MaskPredicateNode> first_, second_;
  bool both_;
};

// The predicate split into the band its conjunction holds (causal, the
// narrowest window) and the conjunction of the rest.
struct SplitPredicate {
  KeyBand band;
  std::vector<const MaskPredicateNode*> rest;

  explicit SplitPredicate(const MaskPredicateNode& predicate) {
    std::vector<const MaskPredicateNode*> conjuncts;
    predicate.add_conjuncts(conjuncts);
    for (const auto* node : conjuncts) {
      const KeyBand* own = node->band();
      if (own == nullptr) {
        rest.push_back(node);
        continue;
      }
      band.causal = true;
      if (own->window > 0) {
        band.window = band.window > 0 ? std::min(band.window, own->window) : own->window;
      }
    }
  }

  uint8_t classify(const PairBlock& block) const {
    if (band_block_kind(band, block) == kEmptyBlock) {
      return kEmptyBlock;
    }
    uint8_t kind = kFullBlock;
    for (const auto* node : rest) {
      const uint8_t own = node->classify(block);
      if (own == kEmptyBlock) {
        return kEmptyBlock;
      }
      if (own == kPartialBlock) {
        kind = kPartialBlock;
      }
    }
    return kind;
  }

  // The key bounds of the rest's conjunction for batch row b: (L, 2), or
  // undefined where no conjunct bounds the keys.
  torch::Tensor key_bounds(int64_t b, int64_t L, int64_t S) const {
    torch::Tensor bounds;
    std::vector<int64_t> own(2 * L);
    for (const auto* node : rest) {
      if (!node->key_bounds(b, L, S, own.data())) {
        continue;
      }
      if (!bounds.defined()) {
        bounds = torch::tensor(own, torch::kLong).view({L, 2});
      } else {
        combine_bounds(bounds.data_ptr<int64_t>(), own.data(), L, /*both=*/true);
      }
    }
    return bounds;
  }

  // The conjunction of the rest over keys [j0, j1) (at most kCols).
  void allows_row(int64_t b, int64_t h, int64_t i, int64_t j0, int64_t j1, uint8_t* out) const {
    std::fill(out, out + (j1 - j0), uint8_t{1});
    std::array<uint8_t, MaskBlocks::kCols> own{};
    for (const auto* node : rest) {
      node->allows_row(b, h, i, j0, j1, own.data());
      for (int64_t j = 0; j < j1 - j0; ++j) {
        out[j] &= own[j];
      }
    }
  }
};

// One row of blocks (a query tile of one (b, h)): the kinds and the
// elements of its partial blocks, one MaskBlocks::kRows × MaskBlocks::kCols tile each.
struct BlockRow {
  std::vector<uint8_t> kinds;
  std::vector<uint8_t> tiles; // one per partial block, in order
};

// The tested kind of a block the predicate leaves undecided, its
// elements written into `tile` (MaskBlocks::kRows × MaskBlocks::kCols, false outside the block).
uint8_t test_pairs(const SplitPredicate& predicate, const PairBlock& block, uint8_t* tile) {
  std::fill(tile, tile + MaskBlocks::kRows * MaskBlocks::kCols, uint8_t{0});
  int64_t allowed = 0;
  for (int64_t i = block.i0; i < block.i1; ++i) {
    uint8_t* row = tile + (i - block.i0) * MaskBlocks::kCols;
    predicate.allows_row(block.b, block.h, i, block.j0, block.j1, row);
    for (int64_t j = 0; j < block.j1 - block.j0; ++j) {
      allowed += row[j];
    }
  }
  const int64_t pairs = (block.i1 - block.i0) * (block.j1 - block.j0);
  return allowed == 0 ? kEmptyBlock : allowed == pairs ? kFullBlock : kPartialBlock;
}

BlockRow block_row(
    const SplitPredicate& predicate,
    int64_t b,
    int64_t h,
    int64_t i0,
    int64_t L,
    int64_t S) {
  const int64_t key_blocks = MaskBlocks::key_blocks(S);
  BlockRow row;
  row.kinds.resize(key_blocks);
  std::vector<uint8_t> tile(MaskBlocks::kRows * MaskBlocks::kCols);
  for (int64_t block = 0; block < key_blocks; ++block) {
    const int64_t j0 = block * MaskBlocks::kCols;
    const PairBlock pairs{
        b, h, i0, std::min(L, i0 + MaskBlocks::kRows), j0, std::min(S, j0 + MaskBlocks::kCols)};
    uint8_t kind = predicate.classify(pairs);
    if (kind == kPartialBlock) {
      kind = test_pairs(predicate, pairs, tile.data());
    }
    row.kinds[block] = kind;
    if (kind == kPartialBlock) {
      row.tiles.insert(row.tiles.end(), tile.begin(), tile.end());
    }
  }
  return row;
}

// The rows' kinds, tiles and tile indices as MaskBlocks of `sizes`.
MaskBlocks assemble(const std::vector<BlockRow>& rows, at::IntArrayRef sizes) {
  MaskBlocks blocks;
  blocks.kinds = torch::empty(sizes, torch::kByte);
  blocks.tile_of = torch::full(sizes, -1, torch::kInt);
  int64_t tiles = 0;
  for (const auto& row : rows) {
    tiles += static_cast<int64_t>(row.tiles.size()) / (MaskBlocks::kRows * MaskBlocks::kCols);
  }
  blocks.tiles = torch::empty({tiles, MaskBlocks::kRows, MaskBlocks::kCols}, torch::kBool);
  auto* kinds = blocks.kinds.data_ptr<uint8_t>();
  auto* tile_of = blocks.tile_of.data_ptr<int32_t>();
  auto* tile_data = reinterpret_cast<uint8_t*>(blocks.tiles.data_ptr<bool>());
  int64_t next = 0, offset = 0;
  for (const auto& row : rows) {
    for (size_t block = 0; block < row.kinds.size(); ++block, ++offset) {
      kinds[offset] = row.kinds[block];
      if (row.kinds[block] == kPartialBlock) {
        tile_of[offset] = static_cast<int32_t>(next++);
      }
    }
    std::copy(row.tiles.begin(), row.tiles.end(), tile_data);
    tile_data += row.tiles.size();
  }
  return blocks;
}

// An integer tensor as (B) int64 on the CPU, for prefix_lm_mask.
torch::Tensor prefix_lengths_of(const torch::Tensor& lengths) {
  TORCH_CHECK(lengths.defined(), "prefix_lm_mask: prefix_lengths must be a defined tensor");
  TORCH_CHECK(
      lengths.dim() <= 1 && lengths.numel() > 0, "prefix_lm_mask: prefix_lengths must be (B) ",
      "or (1), got ", lengths.sizes());
  check_integers("prefix_lm_mask", "prefix_lengths", lengths);
  const auto copy = lengths.reshape({-1}).to(torch::kCPU, torch::kLong).clone();
  TORCH_CHECK(
      copy.min().item<int64_t>() >= 0, "prefix_lm_mask: prefix_lengths must be at least 0, got ",
      copy.min().item<int64_t>());
  return copy;
}

} // namespace

uint8_t band_block_kind(const KeyBand& band, const PairBlock& block) {
  const int64_t begin = std::max(block.j0, band.begin(block.i0));
  const int64_t end = std::min(block.j1, band.end(block.i1 - 1));
  if (begin >= end) {
    return kEmptyBlock;
  }
  // Full where the block's first query sees its last key and its last query its first.
  const bool full = band.end(block.i0) >= block.j1 && band.begin(block.i1 - 1) <= block.j0;
  return full ? kFullBlock : kPartialBlock;
}

void check_integers(const char* caller, const char* name, const torch::Tensor& t) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK(
      !torch::isFloatingType(dtype) && dtype != torch::kBool && !torch::isComplexType(dtype),
      caller, ": ", name, " must hold integers, got ", dtype);
}

void check_block_mask(
    const char* caller,
    const torch::Tensor& query,
    const torch::Tensor& key,
    const SDPAOptions& options) {
  const auto& mask = options.block_mask();
  if (!mask.defined()) {
    return;
  }
  const auto& data = *mask.data();
  const int64_t L = query.size(-2), S = key.size(-2);
  const int64_t H = query.dim() >= 3 ? query.size(-3) : 1;
  int64_t B = 1; // the dims before the heads, flattened
  for (int64_t dim = 0; dim + 3 < query.dim(); ++dim) {
    B *= query.size(dim);
  }
  TORCH_CHECK(
      data.L == L && data.S == S && (data.batch == 1 || data.batch == B) &&
          (data.heads == 1 || data.heads == H),
      caller, ": block_mask was built for scores (batch, heads, L, S) = (", data.batch, ", ",
      data.heads, ", ", data.L, ", ", data.S, "), but the call's are (", B, ", ", H, ", ", L, ", ",
      S, ") (a batch or heads of 1 serves any)");
  const bool options_have_band = options.is_causal() || options.window().has_value() ||
      options.query_offset() != 0;
  const bool mask_has_band = data.band.causal;
  const bool same_band = options.is_causal() && options.query_offset() == 0 &&
      std::min(options.window().value_or(0), kUnboundedWindow) == data.band.window;
  TORCH_CHECK(
      !options_have_band || !mask_has_band || same_band, caller,
      ": block_mask holds a causal band (window ", data.band.window,
      ", 0: none) and is_causal, window and query_offset set another: set it in one place");
}

} // namespace detail

MaskPredicate::MaskPredicate(Function function)
    : node_(std::make_shared<detail::FunctionNode>(std::move(function))) {}

MaskPredicate::MaskPredicate(std::shared_ptr<const detail::MaskPredicateNode> node)
    : node_(std::move(node)) {
  TORCH_CHECK(node_ != nullptr, "MaskPredicate: the predicate must not be null");
}

MaskPredicate MaskPredicate::operator&(const MaskPredicate& other) const {
  return MaskPredicate(std::make_shared<detail::PairNode>(node_, other.node_, true));
}

MaskPredicate MaskPredicate::operator|(const MaskPredicate& other) const {
  return MaskPredicate(std::make_shared<detail::PairNode>(node_, other.node_, false));
}

MaskPredicate causal_mask() {
  return MaskPredicate(std::make_shared<detail::BandNode>(0));
}

MaskPredicate sliding_window_mask(int64_t window) {
  TORCH_CHECK(window > 0, "sliding_window_mask: window must be positive, got ", window);
  return MaskPredicate(
      std::make_shared<detail::BandNode>(std::min(window, detail::kUnboundedWindow)));
}

MaskPredicate document_mask(const torch::Tensor& document_ids) {
  const auto ids = detail::id_rows(document_ids, "document_ids");
  return MaskPredicate(std::make_shared<detail::DocumentNode>(ids, ids));
}

MaskPredicate document_mask(
    const torch::Tensor& query_document_ids,
    const torch::Tensor& key_document_ids) {
  return MaskPredicate(std::make_shared<detail::DocumentNode>(
      detail::id_rows(query_document_ids, "query_document_ids"),
      detail::id_rows(key_document_ids, "key_document_ids")));
}

MaskPredicate prefix_lm_mask(const torch::Tensor& prefix_lengths) {
  return MaskPredicate(
      std::make_shared<detail::PrefixNode>(detail::prefix_lengths_of(prefix_lengths)));
}

BlockMask::BlockMask(std::shared_ptr<const detail::BlockMaskData> data) : data_(std::move(data)) {}

int64_t BlockMask::batch() const {
  return defined() ? data_->batch : 0;
}
int64_t BlockMask::heads() const {
  return defined() ? data_->heads : 0;
}
int64_t BlockMask::query_length() const {
  return defined() ? data_->L : 0;
}
int64_t BlockMask::key_length() const {
  return defined() ? data_->S : 0;
}

double BlockMask::sparsity() const {
  if (!defined() || data_->blocks.kinds.numel() == 0) {
    return 0.0;
  }
  const auto& kinds = data_->blocks.kinds;
  return (kinds == detail::kEmptyBlock).sum().item<double>() / static_cast<double>(kinds.numel());
}

torch::Tensor BlockMask::to_dense() const {
  TORCH_CHECK(defined(), "BlockMask::to_dense: the mask is not defined");
  const auto& d = *data_;
  const int64_t Bm = d.blocks.kinds.size(0), Hm = d.blocks.kinds.size(1);
  constexpr int64_t kCols = detail::MaskBlocks::kCols;
  auto dense = torch::zeros({Bm, Hm, d.L, d.S}, torch::kBool);
  bool* out = dense.data_ptr<bool>();
  const detail::BlockView view(d.blocks);
  for (int64_t b = 0; b < Bm; ++b) {
    for (int64_t h = 0; h < Hm; ++h) {
      for (int64_t i = 0; i < d.L; ++i) {
        const int64_t row = view.row_of(b, h, i);
        bool* out_row = out + ((b * Hm + h) * d.L + i) * d.S;
        for (int64_t j = d.band.begin(i); j < d.band.end(i); ++j) {
          const int64_t block = row + j / kCols;
          const uint8_t kind = view.kinds[block];
          out_row[j] = kind == detail::kFullBlock ||
              (kind == detail::kPartialBlock && view.tile_row(block, i)[j % kCols]);
        }
      }
    }
  }
  return dense.expand({d.batch, d.heads, d.L, d.S});
}

namespace {

// The key bounds of `predicate`'s conjunction for each of `Bm` batch rows:
// (Bm, L, 2), or undefined where none bounds the keys. Each row's ranges
// are widened until both ends are nondecreasing (an earlier begin lowered
// to a later one, a later end raised to an earlier one), which the kernels
// rely on; a wider range only makes them test more pairs.
torch::Tensor key_bounds_of(
    const detail::SplitPredicate& predicate,
    int64_t Bm,
    int64_t L,
    int64_t S) {
  std::vector<torch::Tensor> rows;
  for (int64_t b = 0; b < Bm; ++b) {
    auto row = predicate.key_bounds(b, L, S);
    if (!row.defined()) {
      return {};
    }
    auto* bounds = row.data_ptr<int64_t>();
    for (int64_t i = L - 2; i >= 0; --i) {
      bounds[2 * i] = std::min(bounds[2 * i], bounds[2 * i + 2]);
    }
    for (int64_t i = 1; i < L; ++i) {
      bounds[2 * i + 1] = std::max(bounds[2 * i + 1], bounds[2 * i - 1]);
    }
    rows.push_back(std::move(row));
  }
  return rows.empty() ? torch::Tensor() : torch::stack(rows);
}

// What the int32 tile indices and a tensor per mask can hold.
constexpr int64_t kMaxBlockMaskLength = int64_t{1} << 40;
constexpr double kMostBlocks = 2147483648.0;

} // namespace

BlockMask block_mask(
    const MaskPredicate& predicate,
    int64_t batch,
    int64_t heads,
    int64_t query_length,
    int64_t key_length) {
  TORCH_CHECK(
      batch > 0 && heads > 0 && query_length >= 0 && key_length >= 0, detail::kBlockMaskCaller,
      ": batch and heads must be positive and the lengths at least 0, got (", batch, ", ", heads,
      ", ", query_length, ", ", key_length, ")");
  const auto& node = *predicate.node();
  node.check_sizes(batch, query_length, key_length);
  auto data = std::make_shared<detail::BlockMaskData>();
  data->batch = batch;
  data->heads = heads;
  data->L = query_length;
  data->S = key_length;
  detail::SplitPredicate split(node);
  split.band.S = key_length;
  data->band = split.band;
  data->band_only = split.rest.empty();
  const int64_t Bm = node.depends_on_batch() ? batch : 1;
  const int64_t Hm = node.depends_on_heads() ? heads : 1;
  TORCH_CHECK(
      query_length <= kMaxBlockMaskLength && key_length <= kMaxBlockMaskLength,
      detail::kBlockMaskCaller, ": the lengths must be at most 2^40, got ", query_length, " and ",
      key_length);
  const int64_t Q = detail::MaskBlocks::query_blocks(query_length);
  const double blocks = static_cast<double>(Bm) * static_cast<double>(Hm) * static_cast<double>(Q) *
      static_cast<double>(detail::MaskBlocks::key_blocks(key_length));
  TORCH_CHECK(
      blocks <= kMostBlocks, detail::kBlockMaskCaller, ": (", Bm, ", ", Hm, ") rows of ", Q, " × ",
      detail::MaskBlocks::key_blocks(key_length), " blocks are more than 2^31");
  std::vector<detail::BlockRow> rows(Bm * Hm * Q);
  detail::parallel_for(0, static_cast<int64_t>(rows.size()), 1, [&](int64_t begin, int64_t end) {
    detail::calling_user_function("block_mask: the mask predicate", [&] {
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t b = unit / (Hm * Q), h = unit / Q % Hm,
                      i0 = unit % Q * detail::MaskBlocks::kRows;
        rows[unit] = detail::block_row(split, b, h, i0, query_length, key_length);
      }
    });
  });
  data->blocks = detail::assemble(rows, {Bm, Hm, Q, detail::MaskBlocks::key_blocks(key_length)});
  data->blocks.key_bounds = key_bounds_of(split, Bm, query_length, key_length);
  return BlockMask(std::move(data));
}

} // namespace attn
