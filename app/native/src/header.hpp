// The picture size from a JPEG's markers without libjpeg: a walk over the segments up to the
// first SOS that checks what jpeg_read_header checks on the way. It answers only for the
// plain case (Huffman-coded 8-bit SOF0/SOF1/SOF2, well-formed DQT/DHT/DRI/APPn/COM segments,
// all in the buffer); anything else is left to libjpeg, whose answer (and error message)
// stands.
#pragma once

#include <cstdint>

#include "decode.hpp"

namespace gpufeed_jpeg {

// True with (height, width) where libjpeg-turbo's jpeg_read_header would accept `in` and read
// that size; false where libjpeg must be asked (it may accept or refuse).
bool scan_size(const Input& in, int64_t* height, int64_t* width);

}  // namespace gpufeed_jpeg
