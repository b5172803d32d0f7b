#include "decode.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace gpufeed_jpeg {
namespace {

// PIL's limit for a decompression bomb (Image.MAX_IMAGE_PIXELS * 2): refuse, do not allocate.
constexpr int64_t kMaxPixels = 178956970;

void error_exit(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  longjmp(err->jump, 1);
}

// Warnings that mean the pixels would be invented (the data ends early, or is not valid
// entropy-coded data): an error here, where libjpeg would fill in grey and carry on. Other
// warnings (extraneous bytes before a marker, ...) leave the picture whole and are ignored,
// as torchvision and PIL ignore them.
void emit_message(j_common_ptr cinfo, int level) {
  if (level >= 0) return;
  const int code = cinfo->err->msg_code;
  if (code == JWRN_JPEG_EOF || code == JWRN_HIT_MARKER || code == JWRN_HUFF_BAD_CODE) {
    error_exit(cinfo);
  }
}

// CMYK as Adobe writes it (inverted) to RGB, the formula torchvision and Pillow use.
inline uint8_t cmyk_channel(int k, int cmy) {
  int v = k * cmy + 128;
  v = ((v >> 8) + v) >> 8;
  return static_cast<uint8_t>(std::clamp(k - v, 0, 255));
}

void cmyk_to_rgb(const uint8_t* cmyk, uint8_t* rgb, int width) {
  for (int i = 0; i < width; ++i) {
    const int k = cmyk[4 * i + 3];
    rgb[3 * i] = cmyk_channel(k, 255 - cmyk[4 * i]);
    rgb[3 * i + 1] = cmyk_channel(k, 255 - cmyk[4 * i + 1]);
    rgb[3 * i + 2] = cmyk_channel(k, 255 - cmyk[4 * i + 2]);
  }
}

// The largest of 1/2, 1/4, 1/8 (as n/8) that keeps the box at least the output size.
unsigned dct_scale_num(const Box& box, int out_h, int out_w) {
  unsigned num = 8;
  while (num > 1 && box.height * (num / 2) >= int64_t{out_h} * 8 &&
         box.width * (num / 2) >= int64_t{out_w} * 8) {
    num /= 2;
  }
  return num;
}

// The box edge `pos`..`pos + len` in a picture scaled by num/8 (`limit` pixels): the whole
// pixels [begin, end) that hold it and its exact span within them.
Window scaled_window(int64_t pos, int64_t len, unsigned num, int64_t limit, int64_t* begin,
                     int64_t* end) {
  const double start = pos * (num / 8.0), extent = len * (num / 8.0);
  *begin = std::min(static_cast<int64_t>(std::floor(start)), limit - 1);
  *end = std::clamp(static_cast<int64_t>(std::ceil(start + extent)), *begin + 1, limit);
  return Window{start - *begin, extent, static_cast<int>(*end - *begin)};
}

// The columns [*xoff, *xoff + *xlen) to decode for the box's [x0, x1) in a picture `width`
// wide, so that they come out as in a whole-picture decode. One pixel more on each side: at
// the edge of a cropped region libjpeg's fancy upsampling has no neighbouring chroma. And at
// least 3 chroma samples (3 * max_h_samp pixels): libjpeg-turbo upsamples a narrower row with
// plain replication instead (jdsample.c takes the fancy filter only for downsampled_width > 2),
// which moved a 1-pixel-wide box by up to 16 levels.
void crop_columns(int64_t x0, int64_t x1, int64_t width, int max_h_samp, JDIMENSION* xoff,
                  JDIMENSION* xlen) {
  const int64_t min_width = 3 * int64_t{max_h_samp};
  int64_t begin = std::max<int64_t>(x0 - 1, 0), end = std::min<int64_t>(x1 + 1, width);
  if (end - begin < min_width) {
    end = std::min(begin + min_width, width);
    begin = std::max<int64_t>(end - min_width, 0);
  }
  *xoff = static_cast<JDIMENSION>(begin);
  *xlen = static_cast<JDIMENSION>(end - begin);
}

}  // namespace

Decoder::Decoder() {
  cinfo_.err = jpeg_std_error(&err_.pub);
  err_.pub.error_exit = error_exit;
  err_.pub.emit_message = emit_message;
  if (setjmp(err_.jump)) return;  // out of memory in jpeg_create_decompress: not ready
  jpeg_create_decompress(&cinfo_);
  ready_ = true;
}

Decoder::~Decoder() {
  if (ready_) jpeg_destroy_decompress(&cinfo_);
}

bool Decoder::start(const Input& in) {
  if (in.size < 2 || in.data[0] != 0xFF || in.data[1] != 0xD8) return false;
  jpeg_mem_src(&cinfo_, in.data, static_cast<unsigned long>(in.size));
  jpeg_read_header(&cinfo_, TRUE);
  return true;
}

std::string Decoder::failure() {
  jpeg_abort_decompress(&cinfo_);
  return std::string("corrupt JPEG: ") + err_.message;
}

Image Decoder::read_rows(int rows, int skip, int width, bool cmyk) {
  const size_t scan_bytes = static_cast<size_t>(cinfo_.output_width) * cinfo_.output_components;
  const size_t pitch = cmyk ? static_cast<size_t>(width) * 3 : scan_bytes;
  rows_.resize(static_cast<size_t>(rows) * pitch + kPad);
  if (cmyk) scan_.resize(scan_bytes);
  for (int r = 0; r < rows; ++r) {
    JSAMPROW dst = cmyk ? scan_.data() : rows_.data() + r * pitch;
    jpeg_read_scanlines(&cinfo_, &dst, 1);
    if (cmyk) cmyk_to_rgb(scan_.data() + 4 * skip, rows_.data() + r * pitch, width);
  }
  const size_t offset = cmyk ? 0 : static_cast<size_t>(skip) * 3;
  return Image{rows_.data() + offset, rows, width, pitch};
}

std::string Decoder::size(const Input& in, int64_t* height, int64_t* width) {
  if (setjmp(err_.jump)) return failure();
  if (!start(in)) return "not a JPEG (no start-of-image marker)";
  *height = cinfo_.image_height;
  *width = cinfo_.image_width;
  jpeg_abort_decompress(&cinfo_);
  return {};
}

std::string Decoder::decode(const Input& in, const Job& job, bool dct_scaling) {
  if (setjmp(err_.jump)) return failure();
  if (!start(in)) return "not a JPEG (no start-of-image marker)";
  const int64_t height = cinfo_.image_height, width = cinfo_.image_width;
  const Box& b = job.box;
  if (b.top < 0 || b.left < 0 || b.height < 1 || b.width < 1 || b.top + b.height > height ||
      b.left + b.width > width) {
    jpeg_abort_decompress(&cinfo_);
    return "crop box (top " + std::to_string(b.top) + ", left " + std::to_string(b.left) +
           ", height " + std::to_string(b.height) + ", width " + std::to_string(b.width) +
           ") is not inside the " + std::to_string(height) + "x" + std::to_string(width) +
           " image";
  }
  if (height * width > kMaxPixels) {
    jpeg_abort_decompress(&cinfo_);
    return "image of " + std::to_string(height) + "x" + std::to_string(width) +
           " pixels is over the limit of " + std::to_string(kMaxPixels) +
           " (a decompression bomb?)";
  }
  const bool cmyk = cinfo_.jpeg_color_space == JCS_CMYK || cinfo_.jpeg_color_space == JCS_YCCK;
  cinfo_.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
  const unsigned num = dct_scaling ? dct_scale_num(b, job.out_h, job.out_w) : 8;
  cinfo_.scale_num = num;
  cinfo_.scale_denom = 8;
  jpeg_start_decompress(&cinfo_);

  // The box in the decoded picture: whole pixels [y0, y1) x [x0, x1), and within them the
  // span that is resampled (the box itself, or its fractional place after DCT scaling).
  Window wy{0.0, static_cast<double>(b.height), static_cast<int>(b.height)};
  Window wx{0.0, static_cast<double>(b.width), static_cast<int>(b.width)};
  int64_t y0 = b.top, y1 = b.top + b.height, x0 = b.left, x1 = b.left + b.width;
  if (num != 8) {
    wy = scaled_window(b.top, b.height, num, cinfo_.output_height, &y0, &y1);
    wx = scaled_window(b.left, b.width, num, cinfo_.output_width, &x0, &x1);
  }
  JDIMENSION xoff, xlen;
  crop_columns(x0, x1, cinfo_.output_width, cinfo_.max_h_samp_factor, &xoff, &xlen);
  if (xlen < cinfo_.output_width) jpeg_crop_scanline(&cinfo_, &xoff, &xlen);
  if (y0 > 0) jpeg_skip_scanlines(&cinfo_, static_cast<JDIMENSION>(y0));

  const int box_h = static_cast<int>(y1 - y0), box_w = static_cast<int>(x1 - x0);
  const Image box = read_rows(box_h, static_cast<int>(x0 - xoff), box_w, cmyk);
  jpeg_abort_decompress(&cinfo_);  // the rows below the box are never decoded

  const Image out{job.out, job.out_h, job.out_w, static_cast<size_t>(job.out_w) * 3};
  const bool resize_x = num != 8 || box_w != job.out_w;
  const bool resize_y = num != 8 || box_h != job.out_h;
  // After the horizontal pass (or the copy): straight into `out` when no vertical pass follows.
  Image mid = out;
  if (resize_y) {
    mid_.resize(static_cast<size_t>(box_h) * out.pitch);
    mid = Image{mid_.data(), box_h, job.out_w, out.pitch};
  }
  if (resize_x) {
    compute_taps(wx, job.out_w, horizontal_);
    resize_horizontal(box, horizontal_, job.mirror, mid, side_);
  } else {
    copy_image(box, job.mirror, mid);
  }
  if (resize_y) {
    compute_taps(wy, job.out_h, vertical_);
    resize_vertical(mid, vertical_, out);
  }
  return {};
}

}  // namespace gpufeed_jpeg
