// Decode only a box of a JPEG (libjpeg-turbo: jpeg_crop_scanline for the box's iMCU columns,
// jpeg_skip_scanlines above it, nothing below it), resize it with resize.hpp's kernel and
// mirror it, straight into an RGB output image.
#pragma once

#include <csetjmp>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <jpeglib.h>
#include <jerror.h>

#include "resize.hpp"

namespace gpufeed_jpeg {

struct Box {
  int64_t top, left, height, width;
};

struct Input {
  const uint8_t* data;
  size_t size;
};

// What a decode is asked for: the output image (RGB, out_h x out_w, rows `out_w * 3` bytes
// apart), the box in image pixels and whether to mirror it.
struct Job {
  Box box;
  bool mirror;
  uint8_t* out;
  int out_h, out_w;
};

struct ErrorManager {
  jpeg_error_mgr pub;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

// One per thread: the libjpeg decompressor and the scratch rows, kept across images.
class Decoder {
 public:
  Decoder();
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  // (height, width) of the image, or an error message (empty on success).
  std::string size(const Input& in, int64_t* height, int64_t* width);
  // Decode `job` from `in`; an error message, empty on success. `dct_scaling`: let libjpeg
  // shrink the picture by 2, 4 or 8 in the IDCT while the box stays at least the output size.
  std::string decode(const Input& in, const Job& job, bool dct_scaling);

  bool ready() const { return ready_; }

 private:
  bool start(const Input& in);
  std::string failure();
  // The next `rows` scanlines, `width` pixels from `skip` on, as RGB.
  Image read_rows(int rows, int skip, int width, bool cmyk);

  jpeg_decompress_struct cinfo_{};
  ErrorManager err_{};
  bool ready_ = false;
  std::vector<uint8_t> scan_, rows_, mid_, side_;
  Taps horizontal_, vertical_;
};

}  // namespace gpufeed_jpeg
