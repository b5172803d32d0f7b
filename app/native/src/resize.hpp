// Antialiased bilinear resize of uint8 RGB images with the arithmetic of PyTorch's uint8 CPU
// kernel for _upsample_bilinear2d_aa (aten/src/ATen/native/cpu/UpSampleKernel.cpp:
// HelperInterpBase::_compute_indices_min_size_weights_aa and _compute_index_ranges_int16_weights;
// cpu/UpSampleKernelAVXAntialias.h: the horizontal pass first, rounded to uint8, then the
// vertical one). torchvision.transforms.v2 resizes uint8 images with that kernel, so for the
// same box the pixels are torchvision's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gpufeed_jpeg {

// The taps of one axis: output i reads `count[i]` inputs from `first[i]` on with int16
// weights (row i of `weights`, `stride` wide, zero past count[i]), fixed point with
// `precision` fractional bits.
struct Taps {
  std::vector<int> first, count;
  std::vector<int16_t> weights;
  int stride = 0;
  unsigned precision = 0;
};

// What one axis resamples: `size` input pixels, of which the span [start, start + extent)
// becomes the output (start 0 and extent `size` for a whole box: torch's own mapping; a
// fractional span for a box in a DCT-scaled picture).
struct Window {
  double start, extent;
  int size;
};

void compute_taps(const Window& in, int out_size, Taps& t);

// A 2-D uint8 RGB image: `rows` rows of `width` pixels, `pitch` bytes apart. The source of
// resize_horizontal must have kPad readable bytes after its last pixel.
constexpr int kPad = 8;

struct Image {
  uint8_t* data;
  int rows, width;
  size_t pitch;
};

// src resampled along x to t.first.size() pixels per row (mirrored when asked) into dst,
// which has src.rows rows. `scratch` is reused between calls.
void resize_horizontal(const Image& src, const Taps& t, bool mirror, const Image& dst,
                       std::vector<uint8_t>& scratch);
// src resampled along y to t.first.size() rows into dst (same width).
void resize_vertical(const Image& src, const Taps& t, const Image& dst);
// src copied into dst (same size), mirrored when asked.
void copy_image(const Image& src, bool mirror, const Image& dst);

}  // namespace gpufeed_jpeg
