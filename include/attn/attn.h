#pragma once

/// \file
/// The whole attn API: `#include <attn/attn.h>`.

#include <attn/backend.h>
#include <attn/block_mask.h>
#include <attn/device.h>
#include <attn/functional.h>
#include <attn/interop.h>
#include <attn/kv_cache.h>
#include <attn/modules/multi_head_attention.h>
#include <attn/modules/multi_head_attention_function.h>
#include <attn/modules/rotary_embedding.h>
#include <attn/modules/scaled_dot_product_attention.h>
#include <attn/options.h>
#include <attn/sdpa.h>
#include <attn/threads.h>
#include <attn/version.h>

/// \namespace attn
/// Scaled dot-product and multi-head attention for LibTorch: option structs,
/// functions on tensors, and modules, in the style of `torch::nn`.
