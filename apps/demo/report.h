#pragma once

// What the demo prints: a report for a person, or one JSON object.

#include "arguments.h"
#include "comparison.h"

#include <string>

namespace demo {

/// "self-attention, 8 heads of width 64, causal, last 2 keys padded".
std::string describe_attention(const DemoArguments& arguments);

/// Device, dtype, shapes, forward times, the differences from the built-in,
/// and the attention map of the shown head(s) as a table when it is short.
std::string text_report(const DemoArguments& arguments, const Comparison& comparison);

/// The same facts, less the table, as one JSON object on one line.
std::string json_report(const DemoArguments& arguments, const Comparison& comparison);

} // namespace demo
