#pragma once

/// The whole attn API: `#include <attn/attn.h>`.

#include <attn/device.h>
#include <attn/functional.h>
#include <attn/interop.h>
#include <attn/modules/multi_head_attention.h>
#include <attn/modules/scaled_dot_product_attention.h>
#include <attn/options.h>
