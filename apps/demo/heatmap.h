#pragma once

// The attention map as an SVG image a person can open in a browser.

#include "comparison.h"

#include <string>

namespace demo {

/// One panel per shown head, one cell per weight coloured on a viridis
/// scale from 0 to the largest weight shown, token labels on both axes, the
/// value and pair in each cell's tooltip (and printed in cells large enough),
/// and a colour bar. `caption` says what was run.
std::string heatmap_svg(const AttentionMap& map, const std::string& caption);

} // namespace demo
