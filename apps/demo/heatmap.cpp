#include "heatmap.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>

namespace demo {
namespace {

constexpr const char* kAxesNote = "row: query token, column: key token; each row sums to 1";

// Sizes in pixels. Text widths are estimated from a 12 px sans-serif digit.
constexpr int kCharWidth = 7;
constexpr int kMargin = 16;
constexpr int kTitleHeight = 64;
constexpr int kPanelTitleHeight = 18;
constexpr int kColumnLabelHeight = 16;
constexpr int kLabelHeight = 12;
constexpr int kPanelGap = 28;
// A map is drawn about this wide, within these cell sizes.
constexpr int kTargetGridSize = 480;
constexpr int kMinCell = 4;
constexpr int kMaxCell = 40;
// Cells this large print their value.
constexpr int kValueCell = 30;
constexpr int kBarGap = 28;
constexpr int kBarWidth = 16;
constexpr int kBarLabelWidth = 48;
constexpr int kMinBarHeight = 160;

// Viridis at ten evenly spaced points: perceptually uniform, readable in
// grey and by colour-blind readers. Between points the colour is
// interpolated linearly, exactly as the colour bar's SVG gradient does.
constexpr std::array<std::array<int, 3>, 10> kViridis = {{
    {0x44, 0x01, 0x54},
    {0x48, 0x28, 0x78},
    {0x3e, 0x49, 0x89},
    {0x31, 0x68, 0x8e},
    {0x26, 0x82, 0x8e},
    {0x1f, 0x9e, 0x89},
    {0x35, 0xb7, 0x79},
    {0x6e, 0xce, 0x58},
    {0xb5, 0xde, 0x2b},
    {0xfd, 0xe7, 0x25},
}};

std::string hex_colour(const std::array<int, 3>& rgb) {
  return fmt::format("#{:02x}{:02x}{:02x}", rgb[0], rgb[1], rgb[2]);
}

// `fraction` in [0, 1].
std::string viridis(double fraction) {
  const double position = std::clamp(fraction, 0.0, 1.0) * (kViridis.size() - 1);
  const auto below = std::min<size_t>(static_cast<size_t>(position), kViridis.size() - 2);
  const double weight = position - below;
  std::array<int, 3> rgb{};
  for (size_t channel = 0; channel < 3; ++channel) {
    rgb[channel] = static_cast<int>(std::lround(
        kViridis[below][channel] * (1 - weight) + kViridis[below + 1][channel] * weight));
  }
  return hex_colour(rgb);
}

int label_width(const std::vector<std::string>& labels) {
  size_t longest = 0;
  for (const auto& label : labels) {
    longest = std::max(longest, label.size());
  }
  return static_cast<int>(longest) * kCharWidth;
}

int ceil_div(int numerator, int denominator) {
  return (numerator + denominator - 1) / denominator;
}

struct Layout {
  int cell;
  // Label every row_step-th query and column_step-th key, so that labels
  // never overlap.
  int row_step;
  int column_step;
  int row_label_width;
  int panel_width;
  int panel_height;
  int panel_columns;
  int panel_rows;
  int bar_x;
  int bar_y;
  int bar_height;
  int width;
  int height;

  Layout(const AttentionMap& map, const std::string& caption) {
    const int L = static_cast<int>(map.query_labels.size());
    const int S = static_cast<int>(map.key_labels.size());
    const int panels = static_cast<int>(map.heads.size());
    cell = std::clamp(kTargetGridSize / std::max(L, S), kMinCell, kMaxCell);
    row_step = ceil_div(kLabelHeight, cell);
    column_step = ceil_div(label_width(map.key_labels) + 6, cell);
    row_label_width = label_width(map.query_labels) + 10;
    panel_width = row_label_width + S * cell;
    panel_height = kPanelTitleHeight + kColumnLabelHeight + L * cell;
    panel_columns = static_cast<int>(std::ceil(std::sqrt(panels)));
    panel_rows = ceil_div(panels, panel_columns);

    const int panels_width = panel_columns * panel_width + (panel_columns - 1) * kPanelGap;
    const int panels_height = panel_rows * panel_height + (panel_rows - 1) * kPanelGap;
    bar_x = kMargin + panels_width + kBarGap;
    bar_y = panel_top(0) + kPanelTitleHeight + kColumnLabelHeight;
    bar_height = std::max(kMinBarHeight, panels_height - kPanelTitleHeight - kColumnLabelHeight);
    const auto longest_line = std::max(caption.size(), std::char_traits<char>::length(kAxesNote));
    const int caption_width = static_cast<int>(longest_line) * kCharWidth + 2 * kMargin;
    width = std::max(bar_x + kBarWidth + kBarLabelWidth + kMargin, caption_width);
    height = std::max(kMargin + kTitleHeight + panels_height, bar_y + bar_height) + kMargin;
  }

  int panel_left(int panel) const {
    return kMargin + (panel % panel_columns) * (panel_width + kPanelGap);
  }
  int panel_top(int panel) const {
    return kMargin + kTitleHeight + (panel / panel_columns) * (panel_height + kPanelGap);
  }
};

// Where a panel's grid of cells starts, right of the query labels and below
// the title and key labels.
struct Grid {
  int left;
  int top;
};

Grid panel_grid(const Layout& layout, int panel) {
  return {
      layout.panel_left(panel) + layout.row_label_width,
      layout.panel_top(panel) + kPanelTitleHeight + kColumnLabelHeight};
}

// The panel's title, and every row_step-th query and column_step-th key.
void draw_labels(std::string& svg, const Layout& layout, const AttentionMap& map, int panel) {
  const auto grid = panel_grid(layout, panel);
  const int cell = layout.cell;
  svg += fmt::format(
      "<text x=\"{}\" y=\"{}\" font-weight=\"bold\">head {}</text>\n", grid.left,
      layout.panel_top(panel) + 12, map.heads[panel]);
  const int S = static_cast<int>(map.key_labels.size());
  for (int key = 0; key < S; key += layout.column_step) {
    svg += fmt::format(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
        grid.left + key * cell + cell / 2, grid.top - 5, map.key_labels[key]);
  }
  const int L = static_cast<int>(map.query_labels.size());
  for (int query = 0; query < L; query += layout.row_step) {
    svg += fmt::format(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n", grid.left - 6,
        grid.top + query * cell + cell / 2 + 4, map.query_labels[query]);
  }
}

// The title and labels, then one coloured cell per weight with its pair
// and value in the tooltip, and the value printed in cells large enough.
void draw_panel(
    std::string& svg,
    const Layout& layout,
    const AttentionMap& map,
    int panel,
    double scale_max) {
  svg += "<g class=\"panel\">\n";
  draw_labels(svg, layout, map, panel);
  const auto weights = map.weights[panel].contiguous(); // (L, S)
  const auto* values = weights.data_ptr<double>();
  const auto grid = panel_grid(layout, panel);
  const int cell = layout.cell;
  const int L = static_cast<int>(map.query_labels.size());
  const int S = static_cast<int>(map.key_labels.size());
  for (int query = 0; query < L; ++query) {
    for (int key = 0; key < S; ++key) {
      const double weight = values[query * S + key];
      const double fraction = weight / scale_max;
      const int x = grid.left + key * cell;
      const int y = grid.top + query * cell;
      svg += fmt::format(
          "<rect class=\"cell\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" "
          "fill=\"{}\"><title>{} → {}: {:.4f}</title></rect>\n",
          x, y, cell, cell, viridis(fraction), map.query_labels[query], map.key_labels[key],
          weight);
      if (cell >= kValueCell) {
        // Dark text on the bright (yellow-green) end of the scale.
        svg += fmt::format(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"10\" "
            "fill=\"{}\">{:.2f}</text>\n",
            x + cell / 2, y + cell / 2 + 4, fraction > 0.6 ? "black" : "white", weight);
      }
    }
  }
  svg += "</g>\n";
}

void draw_colour_bar(std::string& svg, const Layout& layout, double scale_max) {
  svg +=
      "<defs><linearGradient id=\"scale\" x1=\"0\" y1=\"1\" x2=\"0\" "
      "y2=\"0\">";
  for (size_t stop = 0; stop < kViridis.size(); ++stop) {
    svg += fmt::format(
        "<stop offset=\"{:.4f}\" stop-color=\"{}\"/>",
        static_cast<double>(stop) / (kViridis.size() - 1), hex_colour(kViridis[stop]));
  }
  svg += "</linearGradient></defs>\n";
  svg += fmt::format("<text x=\"{}\" y=\"{}\">weight</text>\n", layout.bar_x, layout.bar_y - 12);
  svg += fmt::format(
      "<rect class=\"colour-bar\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" "
      "fill=\"url(#scale)\" stroke=\"#444\"/>\n",
      layout.bar_x, layout.bar_y, kBarWidth, layout.bar_height);
  for (const double fraction : {0.0, 0.5, 1.0}) {
    const int y = layout.bar_y + static_cast<int>(std::lround((1 - fraction) * layout.bar_height));
    const int right = layout.bar_x + kBarWidth;
    svg += fmt::format(
        "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#444\"/>"
        "<text x=\"{}\" y=\"{}\">{:.2f}</text>\n",
        right, y, right + 4, y, right + 7, y + 4, fraction * scale_max);
  }
}

} // namespace

std::string heatmap_svg(const AttentionMap& map, const std::string& caption) {
  const Layout layout(map, caption);
  // The scale ends at the largest weight shown: with many keys every weight
  // is small, and a 0-to-1 scale would paint them all the same dark colour.
  const double scale_max = map.weights.max().item<double>();

  std::string svg = fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"{3}\" font-size=\"15\" font-weight=\"bold\">"
      "Attention weights of the first sequence</text>\n"
      "<text x=\"{2}\" y=\"{4}\">{5}</text>\n"
      "<text x=\"{2}\" y=\"{6}\">{7}</text>\n",
      layout.width, layout.height, kMargin, kMargin + 14, kMargin + 32, caption, kMargin + 48,
      kAxesNote);
  for (int panel = 0; panel < static_cast<int>(map.heads.size()); ++panel) {
    draw_panel(svg, layout, map, panel, scale_max);
  }
  draw_colour_bar(svg, layout, scale_max);
  svg += "</svg>\n";
  return svg;
}

} // namespace demo
