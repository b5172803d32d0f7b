#include "header.hpp"

namespace gpufeed_jpeg {
namespace {

// libjpeg-turbo's limits (jmorecfg.h, jpeglib.h) and marker codes (jdmarker.c).
constexpr int kMaxDimension = 65500, kMaxComponents = 10, kMaxCompsInScan = 4;
constexpr int kTables = 4, kMaxSamp = 4;
constexpr uint8_t kSOF0 = 0xC0, kSOF1 = 0xC1, kSOF2 = 0xC2, kDHT = 0xC4, kSOS = 0xDA;
constexpr uint8_t kDQT = 0xDB, kDRI = 0xDD, kAPP0 = 0xE0, kAPP15 = 0xEF, kCOM = 0xFE;

inline int be16(const uint8_t* p) { return (p[0] << 8) | p[1]; }

// The segment bodies after their 2-byte length, `len` bytes at `p`: true where libjpeg reads
// them without an error (jdmarker.c get_dqt, get_dht), 8-bit tables only.
bool dqt_ok(const uint8_t* p, int len) {
  while (len > 0) {
    if (p[0] >= kTables) return false;  // a 16-bit table (high nibble) or a bad index
    p += 65;
    len -= 65;
  }
  return len == 0;
}

bool dht_ok(const uint8_t* p, int len) {
  while (len > 16) {
    const int index = p[0] & ~0x10;
    int count = 0;
    for (int i = 1; i <= 16; ++i) count += p[i];
    len -= 17;
    if (index >= kTables || count > 256 || count > len) return false;
    p += 17 + count;
    len -= count;
  }
  return len == 0;
}

struct Frame {
  int height = 0, width = 0, components = 0;
  bool progressive = false;
  uint8_t ids[kMaxComponents];
};

// SOF0/1/2 (Huffman, 8-bit): the checks of get_sof and of jdinput.c's initial_setup.
bool sof_ok(const uint8_t* p, int len, Frame* f) {
  if (len < 6 || p[0] != 8) return false;
  f->height = be16(p + 1);
  f->width = be16(p + 3);
  f->components = p[5];
  if (f->height < 1 || f->width < 1 || f->height > kMaxDimension || f->width > kMaxDimension ||
      f->components < 1 || f->components > kMaxComponents || len != 6 + 3 * f->components) {
    return false;
  }
  for (int c = 0; c < f->components; ++c) {
    const uint8_t* comp = p + 6 + 3 * c;
    const int h = comp[1] >> 4, v = comp[1] & 15;
    if (h < 1 || h > kMaxSamp || v < 1 || v > kMaxSamp || comp[2] >= kTables) return false;
    f->ids[c] = comp[0];
    for (int d = 0; d < c; ++d) {
      if (f->ids[d] == comp[0]) return false;  // get_sos's lookup differs between versions
    }
  }
  return true;
}

// get_sos: the scan's components named once each, among the frame's first four. In frame
// order only: every libjpeg-turbo version finds those (its lookup of a component named out of
// order has changed between versions).
bool sos_ok(const uint8_t* p, int len, const Frame& f) {
  const int n = p[0];
  if (n < 1 || n > kMaxCompsInScan || len != 2 * n + 4) return false;
  int last = -1;
  for (int i = 0; i < n; ++i) {
    int ci = 0;
    while (ci < f.components && ci < kMaxCompsInScan && f.ids[ci] != p[1 + 2 * i]) ++ci;
    if (ci == f.components || ci == kMaxCompsInScan || ci <= last) return false;
    last = ci;
  }
  // a sequential scan's spectral selection and approximation are fixed (checked later, when
  // decoding starts; here so that a newer libjpeg's stricter header read cannot differ)
  const uint8_t* params = p + 1 + 2 * n;
  return f.progressive || (params[0] == 0 && params[1] == 63 && params[2] == 0);
}

}  // namespace

bool scan_size(const Input& in, int64_t* height, int64_t* width) {
  const uint8_t* data = in.data;
  const size_t size = in.size;
  if (size < 4 || data[0] != 0xFF || data[1] != 0xD8) return false;
  Frame frame;
  bool have_frame = false;
  for (size_t pos = 2;;) {
    // a marker and a whole segment in the buffer; fill bytes, stray bytes, markers without
    // a length (RSTn, TEM, EOI, SOI) and all the rest go to libjpeg
    if (pos + 4 > size || data[pos] != 0xFF) return false;
    const uint8_t marker = data[pos + 1];
    const int length = be16(data + pos + 2);
    if (length < 2 || pos + 2 + length > size) return false;
    const uint8_t* body = data + pos + 4;
    const int len = length - 2;
    if (marker == kSOF0 || marker == kSOF1 || marker == kSOF2) {
      if (have_frame || !sof_ok(body, len, &frame)) return false;
      frame.progressive = marker == kSOF2;
      have_frame = true;
    } else if (marker == kSOS) {
      if (!have_frame || len < 1 || !sos_ok(body, len, frame)) return false;
      *height = frame.height;
      *width = frame.width;
      return true;
    } else if (marker == kDQT) {
      if (!dqt_ok(body, len)) return false;
    } else if (marker == kDHT) {
      if (!dht_ok(body, len)) return false;
    } else if (marker == kDRI) {
      if (len != 2) return false;
    } else if (!((marker >= kAPP0 && marker <= kAPP15) || marker == kCOM)) {
      return false;
    }
    pos += 2 + length;
  }
}

}  // namespace gpufeed_jpeg
