#include "resize.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <cstdlib>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <tmmintrin.h>
#define GPUFEED_HAVE_SSSE3_PATH 1
#endif

namespace gpufeed_jpeg {
namespace {

// Rows resampled together by the horizontal pass: it runs on a block of this many rows
// turned on its side (pixel-major), so that its inner loop is contiguous.
constexpr int kBlockRows = 16;
constexpr int kLanes = kBlockRows * 3;
// Bytes between those pixels: kLanes and room for a 4-byte move of the last row's pixel.
constexpr int kPixel = kLanes + 16;

double bilinear_filter(double x) {
  x = std::abs(x);
  return x < 1.0 ? 1.0 - x : 0.0;
}

inline uint8_t round_shift(int32_t acc, unsigned precision) {
  return static_cast<uint8_t>(std::clamp(acc >> precision, 0, 255));
}

// out[x] = sum over k < count of w[k] * rows[k * pitch + x], rounded and clamped, for x in
// [0, bytes). SSE2 (every x86-64): two taps per multiply (pmaddwd on the bytes of two rows
// interleaved), 16 bytes at a time; the same arithmetic as the scalar tail.
void weighted_rows(const uint8_t* __restrict rows, size_t pitch, int bytes,
                   uint8_t* __restrict out, const int16_t* w, int count, unsigned precision) {
  int x = 0;
#if defined(__SSE2__)
  const __m128i zero = _mm_setzero_si128();
  const __m128i half = _mm_set1_epi32(1 << (precision - 1));
  const __m128i shift = _mm_cvtsi32_si128(static_cast<int>(precision));
  for (; x + 16 <= bytes; x += 16) {
    __m128i acc0 = half, acc1 = half, acc2 = half, acc3 = half;
    int k = 0;
    for (; k + 2 <= count; k += 2) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + k * pitch + x));
      const __m128i b =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + (k + 1) * pitch + x));
      const __m128i wk = _mm_set1_epi32(static_cast<int32_t>(static_cast<uint16_t>(w[k])) |
                                        (static_cast<int32_t>(w[k + 1]) << 16));
      const __m128i lo = _mm_unpacklo_epi8(a, b), hi = _mm_unpackhi_epi8(a, b);
      acc0 = _mm_add_epi32(acc0, _mm_madd_epi16(_mm_unpacklo_epi8(lo, zero), wk));
      acc1 = _mm_add_epi32(acc1, _mm_madd_epi16(_mm_unpackhi_epi8(lo, zero), wk));
      acc2 = _mm_add_epi32(acc2, _mm_madd_epi16(_mm_unpacklo_epi8(hi, zero), wk));
      acc3 = _mm_add_epi32(acc3, _mm_madd_epi16(_mm_unpackhi_epi8(hi, zero), wk));
    }
    if (k < count) {  // an odd tap: paired with a zero weight
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + k * pitch + x));
      const __m128i wk = _mm_set1_epi32(static_cast<int32_t>(static_cast<uint16_t>(w[k])));
      const __m128i lo = _mm_unpacklo_epi8(a, zero), hi = _mm_unpackhi_epi8(a, zero);
      acc0 = _mm_add_epi32(acc0, _mm_madd_epi16(_mm_unpacklo_epi16(lo, zero), wk));
      acc1 = _mm_add_epi32(acc1, _mm_madd_epi16(_mm_unpackhi_epi16(lo, zero), wk));
      acc2 = _mm_add_epi32(acc2, _mm_madd_epi16(_mm_unpacklo_epi16(hi, zero), wk));
      acc3 = _mm_add_epi32(acc3, _mm_madd_epi16(_mm_unpackhi_epi16(hi, zero), wk));
    }
    // arithmetic shift, then saturate to int16 and to uint8: the clamp to [0, 255]
    const __m128i lo16 = _mm_packs_epi32(_mm_sra_epi32(acc0, shift), _mm_sra_epi32(acc1, shift));
    const __m128i hi16 = _mm_packs_epi32(_mm_sra_epi32(acc2, shift), _mm_sra_epi32(acc3, shift));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + x), _mm_packus_epi16(lo16, hi16));
  }
#endif
  for (; x < bytes; ++x) {
    int32_t acc = 1 << (precision - 1);
    for (int k = 0; k < count; ++k) acc += w[k] * rows[k * pitch + x];
    out[x] = round_shift(acc, precision);
  }
}

}  // namespace

void compute_taps(const Window& in, int out_size, Taps& t) {
  const double scale = in.extent / out_size;
  const double support = scale >= 1.0 ? scale : 1.0;  // interp_size 2, times 0.5
  const int max_taps = static_cast<int>(std::ceil(support)) * 2 + 1;
  const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
  thread_local std::vector<double> real;
  real.assign(static_cast<size_t>(out_size) * max_taps, 0.0);
  t.first.assign(out_size, 0);
  t.count.assign(out_size, 0);
  t.stride = max_taps;
  double wt_max = 0.0;
  for (int i = 0; i < out_size; ++i) {
    const double center = in.start + scale * (i + 0.5);
    const int64_t xmin = std::max(static_cast<int64_t>(center - support + 0.5), int64_t{0});
    int64_t xsize = std::min(static_cast<int64_t>(center + support + 0.5),
                             static_cast<int64_t>(in.size)) - xmin;
    xsize = std::clamp(xsize, int64_t{0}, static_cast<int64_t>(max_taps));
    double* w = &real[static_cast<size_t>(i) * max_taps];
    double total = 0.0;
    for (int64_t j = 0; j < xsize; ++j) {
      w[j] = bilinear_filter((j + xmin - center + 0.5) * invscale);
      total += w[j];
    }
    if (total != 0.0) {
      for (int64_t j = 0; j < xsize; ++j) {
        w[j] /= total;
        wt_max = std::max(wt_max, w[j]);
      }
    }
    t.first[i] = static_cast<int>(xmin);
    t.count[i] = static_cast<int>(xsize);
  }
  unsigned precision = 0;
  for (; precision < 22; ++precision) {
    const int next = static_cast<int>(0.5 + wt_max * (1 << (precision + 1)));
    if (next >= (1 << 15)) break;
  }
  t.precision = precision;
  t.weights.resize(real.size());
  for (size_t k = 0; k < real.size(); ++k) {
    const double v = real[k] * (1 << precision);
    t.weights[k] = static_cast<int16_t>(v < 0 ? static_cast<int>(-0.5 + v)
                                              : static_cast<int>(0.5 + v));
  }
}

namespace {

// The portable horizontal pass: the block of rows turned on its side (pixel-major), so that
// weighted_rows runs along contiguous memory.
void resize_horizontal_blocks(const Image& src, const Taps& t, bool mirror, const Image& dst,
                              std::vector<uint8_t>& scratch) {
  const int n = static_cast<int>(t.first.size());
  scratch.resize(static_cast<size_t>(src.width + n) * kPixel);
  uint8_t* side = scratch.data();                                   // [width][kPixel]
  uint8_t* done = side + static_cast<size_t>(src.width) * kPixel;  // [n][kPixel]
  for (int r0 = 0; r0 < src.rows; r0 += kBlockRows) {
    const int rows = std::min(kBlockRows, src.rows - r0);
    // 4-byte moves of 3-byte pixels: the extra byte lands where the next move writes (rows
    // in increasing order; the padding after the last one), or in Image::pad.
    for (int r = 0; r < rows; ++r) {
      const uint8_t* row = src.data + (r0 + r) * src.pitch;
      for (int x = 0; x < src.width; ++x) std::memcpy(side + x * kPixel + r * 3, row + 3 * x, 4);
    }
    for (int i = 0; i < n; ++i) {
      weighted_rows(side + static_cast<size_t>(t.first[i]) * kPixel, kPixel, kLanes,
                    done + i * kPixel, t.weights.data() + static_cast<size_t>(i) * t.stride,
                    t.count[i], t.precision);
    }
    for (int r = 0; r < rows; ++r) {
      uint8_t* row = dst.data + (r0 + r) * dst.pitch;
      // left to right, so that each move's extra byte is overwritten by the next one
      for (int x = 0; x + 1 < n; ++x) {
        std::memcpy(row + 3 * x, done + (mirror ? n - 1 - x : x) * kPixel + r * 3, 4);
      }
      std::memcpy(row + 3 * (n - 1), done + (mirror ? 0 : n - 1) * kPixel + r * 3, 3);
    }
  }
}

#ifdef GPUFEED_HAVE_SSSE3_PATH
// SSSE3 (every x86-64 CPU since 2006, checked at run time): one output pixel at a time, two
// taps per pmaddwd, the bytes of two neighbouring pixels paired by one pshufb:
// (R0 R1) (G0 G1) (B0 B1) as int16 pairs against (w0 w1).
__attribute__((target("ssse3"))) void resize_horizontal_pairs(const Image& src, const Taps& t,
                                                              bool mirror, const Image& dst,
                                                              std::vector<uint8_t>& scratch) {
  const int n = static_cast<int>(t.first.size());
  const int pairs = (t.stride + 1) / 2;
  // the weight pairs of each output pixel, in the order the pixels are written
  scratch.resize(static_cast<size_t>(n) * pairs * sizeof(__m128i) + sizeof(__m128i));
  auto* wp = reinterpret_cast<__m128i*>(
      (reinterpret_cast<uintptr_t>(scratch.data()) + 15) & ~uintptr_t{15});
  std::vector<int> first(n), npairs(n);
  for (int x = 0; x < n; ++x) {
    const int i = mirror ? n - 1 - x : x;
    const int16_t* w = t.weights.data() + static_cast<size_t>(i) * t.stride;
    first[x] = 3 * t.first[i];
    npairs[x] = (t.count[i] + 1) / 2;
    for (int p = 0; p < npairs[x]; ++p) {
      const int k = 2 * p;
      const int16_t w1 = k + 1 < t.count[i] ? w[k + 1] : 0;
      wp[x * pairs + p] = _mm_set1_epi32(static_cast<int32_t>(static_cast<uint16_t>(w[k])) |
                                         (static_cast<int32_t>(w1) << 16));
    }
  }
  const __m128i pair_bytes = _mm_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
  const __m128i half = _mm_set1_epi32(1 << (t.precision - 1));
  const __m128i shift = _mm_cvtsi32_si128(static_cast<int>(t.precision));
  for (int r = 0; r < src.rows; ++r) {
    const uint8_t* row = src.data + r * src.pitch;
    uint8_t* out = dst.data + r * dst.pitch;
    for (int x = 0; x < n; ++x) {
      const uint8_t* s = row + first[x];
      const __m128i* w = wp + x * pairs;
      __m128i acc = half;
      for (int p = 0; p < npairs[x]; ++p) {
        // 8 bytes from pixel 2p on: two pixels and 2 bytes more (Image::pad)
        const __m128i px = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 6 * p));
        acc = _mm_add_epi32(acc, _mm_madd_epi16(_mm_shuffle_epi8(px, pair_bytes), w[p]));
      }
      __m128i v = _mm_sra_epi32(acc, shift);
      v = _mm_packus_epi16(_mm_packs_epi32(v, v), v);
      const uint32_t rgbx = static_cast<uint32_t>(_mm_cvtsi128_si32(v));
      std::memcpy(out + 3 * x, &rgbx, x + 1 < n ? 4 : 3);  // the 4th byte: the next pixel's
    }
  }
}

bool use_ssse3() {
  static const bool yes =
      __builtin_cpu_supports("ssse3") && std::getenv("GPUFEED_JPEG_PORTABLE") == nullptr;
  return yes;
}
#endif

}  // namespace

void resize_horizontal(const Image& src, const Taps& t, bool mirror, const Image& dst,
                       std::vector<uint8_t>& scratch) {
#ifdef GPUFEED_HAVE_SSSE3_PATH
  if (use_ssse3()) return resize_horizontal_pairs(src, t, mirror, dst, scratch);
#endif
  resize_horizontal_blocks(src, t, mirror, dst, scratch);
}

void resize_vertical(const Image& src, const Taps& t, const Image& dst) {
  const int n = static_cast<int>(t.first.size());
  for (int y = 0; y < n; ++y) {
    weighted_rows(src.data + t.first[y] * src.pitch, src.pitch, src.width * 3,
                  dst.data + y * dst.pitch, t.weights.data() + static_cast<size_t>(y) * t.stride,
                  t.count[y], t.precision);
  }
}

void copy_image(const Image& src, bool mirror, const Image& dst) {
  for (int r = 0; r < src.rows; ++r) {
    const uint8_t* s = src.data + r * src.pitch;
    uint8_t* d = dst.data + r * dst.pitch;
    if (!mirror) {
      std::memcpy(d, s, static_cast<size_t>(src.width) * 3);
      continue;
    }
    for (int x = 0; x < src.width; ++x) std::memcpy(d + 3 * x, s + 3 * (src.width - 1 - x), 3);
  }
}

}  // namespace gpufeed_jpeg
