// gpufeed_jpeg: crop-aware JPEG decode + antialiased resize + mirror for a whole batch per
// call, on a pool of threads that runs without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "decode.hpp"
#include "header.hpp"

namespace py = pybind11;
using namespace gpufeed_jpeg;

namespace {

#define GPUFEED_STR2(x) #x
#define GPUFEED_STR(x) GPUFEED_STR2(x)

// The payloads' bytes, held (PyObject_GetBuffer keeps each exporter alive and unresizable)
// for as long as the threads read them.
class Payloads {
 public:
  explicit Payloads(const py::sequence& seq) {
    const size_t n = py::len(seq);
    views_.reserve(n);
    inputs_.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      py::object item = seq[i];
      views_.emplace_back();
      if (PyObject_GetBuffer(item.ptr(), &views_.back(), PyBUF_SIMPLE) != 0) {
        views_.pop_back();
        throw py::error_already_set();
      }
      const Py_buffer& v = views_.back();
      inputs_.push_back({static_cast<const uint8_t*>(v.buf), static_cast<size_t>(v.len)});
    }
  }
  ~Payloads() {
    for (auto& v : views_) PyBuffer_Release(&v);
  }
  Payloads(const Payloads&) = delete;
  Payloads& operator=(const Payloads&) = delete;

  size_t size() const { return inputs_.size(); }
  const Input& operator[](size_t i) const { return inputs_[i]; }

 private:
  std::vector<Py_buffer> views_;
  std::vector<Input> inputs_;
};

// Run fn(decoder, i) for i in [0, n) on `threads` threads (the caller's among them), each with
// its own Decoder, taking items in turn. Called without the GIL.
template <class Fn>
void run_parallel(size_t n, int threads, std::vector<std::string>& errors, Fn fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    Decoder decoder;
    for (size_t i = next++; i < n; i = next++) {
      errors[i] = decoder.ready() ? fn(decoder, i) : "out of memory starting the JPEG decoder";
    }
  };
  const int extra = static_cast<int>(std::min<size_t>(std::max(threads, 1), n)) - 1;
  std::vector<std::thread> pool;
  pool.reserve(std::max(extra, 0));
  for (int t = 0; t < extra; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

py::list failures(const std::vector<std::string>& errors) {
  py::list out;
  for (size_t i = 0; i < errors.size(); ++i) {
    if (!errors[i].empty()) out.append(py::make_tuple(i, errors[i]));
  }
  return out;
}

void check_threads(int threads) {
  if (threads < 1) throw py::value_error("threads must be >= 1, got " + std::to_string(threads));
}

// A batch's payloads lie anywhere in a mapped file, out of the CPU's caches: the walk asks for
// the header of the image kAhead on while it reads this one, so that the misses overlap.
constexpr size_t kAhead = 8, kHeaderBytes = 768;

void prefetch_header(const Input& in) {
  const size_t bytes = std::min<size_t>(in.size, kHeaderBytes);
  for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(in.data + off);
}

py::tuple image_sizes(const py::sequence& seq, int threads, bool scan) {
  check_threads(threads);
  Payloads payloads(seq);
  const size_t n = payloads.size();
  py::array_t<int64_t> sizes({static_cast<py::ssize_t>(n), py::ssize_t{2}});
  int64_t* hw = sizes.mutable_data();
  std::fill(hw, hw + 2 * n, -1);
  std::vector<std::string> errors(n);
  {
    py::gil_scoped_release nogil;
    // the marker walk (tens of nanoseconds an image: one thread, no decoder) first; libjpeg's
    // jpeg_read_header, on `threads` threads, for what it leaves
    std::vector<size_t> asked;
    for (size_t i = 0; i < n; ++i) {
      if (scan && i + kAhead < n) prefetch_header(payloads[i + kAhead]);
      if (!scan || !scan_size(payloads[i], &hw[2 * i], &hw[2 * i + 1])) asked.push_back(i);
    }
    std::vector<std::string> asked_errors(asked.size());
    run_parallel(asked.size(), threads, asked_errors, [&](Decoder& d, size_t k) {
      const size_t i = asked[k];
      return d.size(payloads[i], &hw[2 * i], &hw[2 * i + 1]);
    });
    for (size_t k = 0; k < asked.size(); ++k) errors[asked[k]] = std::move(asked_errors[k]);
  }
  return py::make_tuple(sizes, failures(errors));
}

py::array_t<int64_t> scan_sizes(const py::sequence& seq) {
  Payloads payloads(seq);
  const size_t n = payloads.size();
  py::array_t<int64_t> sizes({static_cast<py::ssize_t>(n), py::ssize_t{2}});
  int64_t* hw = sizes.mutable_data();
  for (size_t i = 0; i < n; ++i) {
    if (!scan_size(payloads[i], &hw[2 * i], &hw[2 * i + 1])) hw[2 * i] = hw[2 * i + 1] = -1;
  }
  return sizes;
}

py::list decode_crops(const py::sequence& seq, py::array_t<int64_t, py::array::c_style> boxes,
                      py::array_t<bool, py::array::c_style> mirror, py::buffer out, int threads,
                      bool dct_scaling) {
  check_threads(threads);
  Payloads payloads(seq);
  const size_t n = payloads.size();
  py::buffer_info o = out.request(true);
  if (o.ndim != 4 || o.shape[3] != 3 || o.itemsize != 1 || o.format != "B") {
    throw py::value_error("out must be a uint8 array of shape (N, height, width, 3)");
  }
  const py::ssize_t out_h = o.shape[1], out_w = o.shape[2];
  if (o.strides[3] != 1 || o.strides[2] != 3 || o.strides[1] != 3 * out_w ||
      o.strides[0] != 3 * out_w * out_h) {
    throw py::value_error("out must be C-contiguous (N, height, width, 3)");
  }
  if (static_cast<size_t>(o.shape[0]) < n || out_h < 1 || out_w < 1) {
    throw py::value_error("out holds " + std::to_string(o.shape[0]) + " images of " +
                          std::to_string(out_h) + "x" + std::to_string(out_w) + ", need " +
                          std::to_string(n) + " of at least 1x1");
  }
  if (boxes.ndim() != 2 || static_cast<size_t>(boxes.shape(0)) != n || boxes.shape(1) != 4) {
    throw py::value_error("boxes must be an int64 array of shape (N, 4): top, left, height, width");
  }
  if (mirror.ndim() != 1 || static_cast<size_t>(mirror.shape(0)) != n) {
    throw py::value_error("mirror must be a bool array of shape (N,)");
  }
  const int64_t* bx = boxes.data();
  const bool* flip = mirror.data();
  auto* base = static_cast<uint8_t*>(o.ptr);
  const size_t image_bytes = static_cast<size_t>(out_h * out_w * 3);
  std::vector<std::string> errors(n);
  {
    py::gil_scoped_release nogil;
    run_parallel(n, threads, errors, [&](Decoder& d, size_t i) {
      const Job job{{bx[4 * i], bx[4 * i + 1], bx[4 * i + 2], bx[4 * i + 3]},
                    flip[i],
                    base + i * image_bytes,
                    static_cast<int>(out_h),
                    static_cast<int>(out_w)};
      std::string e = d.decode(payloads[i], job, dct_scaling);
      if (!e.empty()) std::fill(job.out, job.out + image_bytes, 0);
      return e;
    });
  }
  return failures(errors);
}

}  // namespace

PYBIND11_MODULE(gpufeed_jpeg, m) {
  m.doc() =
      "Batch JPEG decode + crop + antialiased resize + mirror (libjpeg-turbo), without the GIL.";
  m.attr("LIBJPEG_TURBO_VERSION") = GPUFEED_STR(LIBJPEG_TURBO_VERSION);
  m.attr("JPEG_LIB_VERSION") = JPEG_LIB_VERSION;
  m.def("image_sizes", &image_sizes, py::arg("payloads"), py::arg("threads") = 1,
        py::arg("scan") = true,
        "(sizes int64 [N, 2] of (height, width), -1 where unreadable; [(i, message)] for "
        "those) from the JPEG headers, without the GIL. scan: read the plain headers' markers "
        "directly (the same answers, faster); libjpeg's jpeg_read_header reads the others, "
        "on `threads` threads (scan=False: all of them).");
  m.def("scan_sizes", &scan_sizes, py::arg("payloads"),
        "The marker walk of image_sizes alone: int64 [N, 2] (height, width), -1 where it "
        "leaves the header to libjpeg (for tests: its answers must be libjpeg's).");
  m.def("decode_crops", &decode_crops, py::arg("payloads"), py::arg("boxes"),
        py::arg("mirror"), py::arg("out"), py::arg("threads") = 1,
        py::arg("dct_scaling") = false,
        "Decode box i = (top, left, height, width) of JPEG i, resize it to out's (height, "
        "width) with torch's antialiased bilinear uint8 kernel, mirror it where mirror[i], "
        "into out[i] (uint8 (N, height, width, 3), C-contiguous). Returns [(i, message)] for "
        "the images that failed (their out[i] is zeroed). dct_scaling: let libjpeg-turbo "
        "shrink by 2/4/8 in the IDCT first (faster, not torchvision's pixels).");
}
