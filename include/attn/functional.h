#pragma once

/// \file
/// Attention as plain functions on tensors, as `torch::nn::functional`
/// has both: scaled dot-product attention (`<attn/sdpa.h>`) and
/// multi-head attention as a function of its parameters
/// (`<attn/modules/multi_head_attention_function.h>`).

#include <attn/modules/multi_head_attention_function.h>
#include <attn/sdpa.h>
