// Image decoding and the Qwen2-VL image processor (image.h).
#include "image.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "common.h"

#ifndef SPX_IMAGE_PNG
#if __has_include(<png.h>)
#define SPX_IMAGE_PNG 1
#else
#define SPX_IMAGE_PNG 0
#endif
#endif
#ifndef SPX_IMAGE_JPEG
// jpeglib.h needs the target's jconfig.h: a cross compiler may see the host's jpeglib.h without it
#if __has_include(<jpeglib.h>) && __has_include(<jconfig.h>)
#define SPX_IMAGE_JPEG 1
#else
#define SPX_IMAGE_JPEG 0
#endif
#endif

#if SPX_IMAGE_PNG
#include <png.h>
#endif
#if SPX_IMAGE_JPEG
#include <jerror.h>
#include <jpeglib.h>
// Pillow decodes with libjpeg-turbo (2.x / 3.x); IJG libjpeg 7+ and libjpeg-turbo before 2.0 upsample
// chroma differently, which would give other pixels without any error
#if !defined(LIBJPEG_TURBO_VERSION_NUMBER) || LIBJPEG_TURBO_VERSION_NUMBER < 2000000
#error "image.cpp needs libjpeg-turbo 2.0 or newer (Pillow's JPEG decoder); build with -DSPX_IMAGE_JPEG=0 without it"
#endif
#endif

namespace spx {

namespace {

[[maybe_unused]] std::string fmt_pixels(int64_t w, int64_t h) {
  char b[96];
  std::snprintf(b, sizeof b, "%lldx%lld (%.1f megapixels)", static_cast<long long>(w), static_cast<long long>(h),
                static_cast<double>(w) * static_cast<double>(h) / 1e6);
  return b;
}

[[maybe_unused]] void check_pixels(const std::string& path, int64_t w, int64_t h) {
  if (w < 1 || h < 1) throw Error(path + ": image size " + std::to_string(w) + "x" + std::to_string(h) + " is empty");
  if (w > kMaxImagePixels || h > kMaxImagePixels || w * h > kMaxImagePixels)  // no overflow: each side first
    throw Error(path + ": image is " + fmt_pixels(w, h) + "; images over " + std::to_string(kMaxImagePixels / 1000000) +
                " megapixels are refused");
}

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<FILE, FileCloser>;

// ---------------------------------------------------------------------------------------------
// PNG (libpng). libpng reports errors through longjmp; every function that calls into it sets
// its own jump point and holds nothing with a destructor, so the jump skips no C++ cleanup.
#if SPX_IMAGE_PNG

struct PngErr {
  std::jmp_buf jb;
  char msg[200];
};

[[noreturn]] void png_fail(png_structp png, png_const_charp m) {
  auto* e = static_cast<PngErr*>(png_get_error_ptr(png));
  std::snprintf(e->msg, sizeof e->msg, "%s", m ? m : "error");
  std::longjmp(e->jb, 1);
}

void png_quiet(png_structp, png_const_charp) {}

struct PngHeader {
  png_uint_32 width = 0, height = 0;
  int bit_depth = 0, color_type = 0;
  int palette_size = 0;
  uint8_t palette[256 * 3] = {};  // PLTE; entries past it stay black, as in Pillow
};

// IHDR (and the chunks before the first IDAT); the signature was checked by the caller.
bool png_header(png_structp png, png_infop info, FILE* f, PngErr* e, PngHeader* h) {
  if (setjmp(e->jb)) return false;
  png_init_io(png, f);
  png_set_sig_bytes(png, 8);
  // a bad checksum on a chunk before the image data is an error, as in Pillow (which checks those)
  png_set_crc_action(png, PNG_CRC_DEFAULT, PNG_CRC_ERROR_QUIT);
  png_read_info(png, info);
  h->width = png_get_image_width(png, info);
  h->height = png_get_image_height(png, info);
  h->bit_depth = png_get_bit_depth(png, info);
  h->color_type = png_get_color_type(png, info);
  png_colorp plte = nullptr;
  int n = 0;
  if (h->color_type == PNG_COLOR_TYPE_PALETTE && png_get_PLTE(png, info, &plte, &n) && plte) {
    h->palette_size = std::min(n, 256);
    for (int i = 0; i < h->palette_size; ++i) {
      h->palette[3 * i] = plte[i].red;
      h->palette[3 * i + 1] = plte[i].green;
      h->palette[3 * i + 2] = plte[i].blue;
    }
  }
  return true;
}

// The samples as stored (1/2/4-bit ones one a byte, 16-bit ones big-endian), de-interlaced.
bool png_pixels(png_structp png, png_infop info, PngErr* e, int bit_depth, uint8_t* buf, size_t rowbytes,
                png_uint_32 height) {
  if (setjmp(e->jb)) return false;
  // IDAT's checksum is not checked: Pillow's PNG reader (its own, not libpng) skips it; a corrupt
  // zlib stream inside is still an error
  png_set_crc_action(png, PNG_CRC_QUIET_USE, PNG_CRC_ERROR_QUIT);
  if (bit_depth < 8) png_set_packing(png);
  const int passes = png_set_interlace_handling(png);
  png_read_update_info(png, info);
  if (png_get_rowbytes(png, info) != rowbytes) png_error(png, "unexpected row size");
  for (int pass = 0; pass < passes; ++pass)
    for (png_uint_32 y = 0; y < height; ++y) png_read_row(png, buf + static_cast<size_t>(y) * rowbytes, nullptr);
  return true;
}

struct PngGuard {
  png_structp png = nullptr;
  png_infop info = nullptr;
  ~PngGuard() { png_destroy_read_struct(&png, info ? &info : nullptr, nullptr); }
};

Rgb8Image decode_png(const std::string& path, FILE* f) {
  PngErr err{};
  PngGuard g;
  g.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &err, png_fail, png_quiet);
  if (!g.png) throw Error(path + ": libpng could not start (out of memory?)");
  g.info = png_create_info_struct(g.png);
  if (!g.info) throw Error(path + ": libpng could not start (out of memory?)");
  auto corrupt = [&]() { return Error(path + ": truncated or corrupt PNG (libpng: " + err.msg + ")"); };
  PngHeader h;
  if (!png_header(g.png, g.info, f, &err, &h)) throw corrupt();
  check_pixels(path, h.width, h.height);
  const int ct = h.color_type, depth = h.bit_depth;
  int channels = 0;
  switch (ct) {
    case PNG_COLOR_TYPE_GRAY: channels = 1; break;
    case PNG_COLOR_TYPE_PALETTE: channels = 1; break;
    case PNG_COLOR_TYPE_GRAY_ALPHA: channels = 2; break;
    case PNG_COLOR_TYPE_RGB: channels = 3; break;
    case PNG_COLOR_TYPE_RGB_ALPHA: channels = 4; break;
    default: throw Error(path + ": corrupt PNG (colour type " + std::to_string(ct) + ")");
  }
  const size_t bps = depth == 16 ? 2 : 1;  // bytes a sample, after unpacking
  const size_t rowbytes = static_cast<size_t>(h.width) * channels * bps;
  // the samples as stored are up to 8 bytes a pixel (RGBA, 16-bit): capped, from the header, before
  // any allocation (check_pixels caps the pixels; this the bytes a deep format needs for them)
  if (static_cast<uint64_t>(rowbytes) * h.height > kMaxImageBytes)
    throw Error(path + ": image is " + fmt_pixels(h.width, h.height) + " of " + std::to_string(channels * bps) +
                " bytes a pixel; images over " + std::to_string(kMaxImageBytes >> 20) + " MiB decoded are refused");
  std::vector<uint8_t> raw(rowbytes * h.height);
  if (!png_pixels(g.png, g.info, &err, depth, raw.data(), rowbytes, h.height)) throw corrupt();

  Rgb8Image out;
  out.width = static_cast<int>(h.width);
  out.height = static_cast<int>(h.height);
  const size_t n = static_cast<size_t>(h.width) * h.height;
  out.pixels.resize(n * 3);
  uint8_t* o = out.pixels.data();
  const uint8_t* s = raw.data();
  if (ct == PNG_COLOR_TYPE_PALETTE) {
    for (size_t i = 0; i < n; ++i) std::memcpy(o + 3 * i, h.palette + 3 * s[i], 3);
  } else if (ct == PNG_COLOR_TYPE_GRAY || ct == PNG_COLOR_TYPE_GRAY_ALPHA) {
    const size_t stride = channels * bps;
    for (size_t i = 0; i < n; ++i) {
      const uint8_t* p = s + i * stride;
      uint8_t v;
      if (depth == 16) {
        // grey alone: Pillow's I;16 -> RGB clips to 255; grey + alpha (Pillow's LA;16B): high byte
        v = ct == PNG_COLOR_TYPE_GRAY ? static_cast<uint8_t>(std::min(255, (p[0] << 8) | p[1])) : p[0];
      } else if (depth < 8) {
        v = static_cast<uint8_t>(p[0] * (255 / ((1 << depth) - 1)));  // 1: x255, 2: x85, 4: x17
      } else {
        v = p[0];
      }
      o[3 * i] = o[3 * i + 1] = o[3 * i + 2] = v;
    }
  } else {  // RGB, RGBA: the colour samples' high (or only) byte
    const size_t stride = channels * bps;
    for (size_t i = 0; i < n; ++i)
      for (int c = 0; c < 3; ++c) o[3 * i + c] = s[i * stride + c * bps];
  }
  return out;
}

#endif  // SPX_IMAGE_PNG

// ---------------------------------------------------------------------------------------------
// JPEG (libjpeg-turbo), with the same longjmp discipline as the PNG reader.
#if SPX_IMAGE_JPEG

struct JpegErr {
  jpeg_error_mgr pub;
  std::jmp_buf jb;
  char msg[JMSG_LENGTH_MAX];
  bool eof;  // the data ran out (libjpeg then pretends an EOI marker and goes on)
};

[[noreturn]] void jpeg_fail(j_common_ptr c) {
  auto* e = reinterpret_cast<JpegErr*>(c->err);
  (*c->err->format_message)(c, e->msg);
  std::longjmp(e->jb, 1);
}

// Warnings are ignored, as Pillow ignores them, except the one that says the file ended early.
void jpeg_note(j_common_ptr c, int level) {
  if (level < 0 && c->err->msg_code == JWRN_JPEG_EOF) reinterpret_cast<JpegErr*>(c->err)->eof = true;
}

bool jpeg_header(jpeg_decompress_struct* ci, FILE* f, JpegErr* e) {
  if (setjmp(e->jb)) return false;
  jpeg_create_decompress(ci);
  jpeg_stdio_src(ci, f);
  jpeg_read_header(ci, TRUE);
  return true;
}

// Every row; *complete: the data lasted to the last row. Nothing past it is read unless it did.
bool jpeg_pixels(jpeg_decompress_struct* ci, JpegErr* e, uint8_t* buf, bool* complete) {
  if (setjmp(e->jb)) return false;
  jpeg_start_decompress(ci);
  // buf holds image_width x image_height x num_components: nothing else is written into it
  if (ci->output_width != ci->image_width || ci->output_height != ci->image_height ||
      ci->output_components != ci->num_components)
    ERREXIT(ci, JERR_BAD_DCTSIZE);
  const size_t stride = static_cast<size_t>(ci->output_width) * ci->output_components;
  while (ci->output_scanline < ci->output_height) {
    JSAMPROW row = buf + ci->output_scanline * stride;
    jpeg_read_scanlines(ci, &row, 1);
  }
  *complete = !e->eof;
  if (*complete) jpeg_finish_decompress(ci);
  return true;
}

struct JpegGuard {
  jpeg_decompress_struct* ci;
  ~JpegGuard() { jpeg_destroy_decompress(ci); }  // safe before create too: the struct starts zeroed
};

Rgb8Image decode_jpeg(const std::string& path, FILE* f) {
  JpegErr err{};
  jpeg_decompress_struct ci{};
  ci.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = jpeg_fail;
  err.pub.emit_message = jpeg_note;
  JpegGuard g{&ci};
  auto failed = [&]() {
    if (err.eof) return Error(path + ": truncated JPEG (the data ends early)");
    return Error(path + ": corrupt JPEG (libjpeg: " + err.msg + ")");
  };
  if (!jpeg_header(&ci, f, &err)) throw failed();
  if (err.eof) throw failed();
  check_pixels(path, ci.image_width, ci.image_height);
  if (ci.num_components == 1) {
    ci.out_color_space = JCS_GRAYSCALE;
  } else if (ci.num_components == 3) {
    ci.out_color_space = JCS_RGB;
  } else {
    throw Error(path + ": a JPEG of " + std::to_string(ci.num_components) +
                " components (CMYK or YCCK?); only grey and colour (YCbCr, RGB) JPEGs are supported");
  }
  const int comps = ci.num_components;
  std::vector<uint8_t> raw(static_cast<size_t>(ci.image_width) * ci.image_height * comps);
  bool complete = false;
  if (!jpeg_pixels(&ci, &err, raw.data(), &complete)) throw failed();
  if (!complete) throw failed();
  if (ci.output_width != ci.image_width || ci.output_height != ci.image_height ||
      ci.output_components != comps)
    throw Error(path + ": corrupt JPEG (unexpected output geometry)");

  Rgb8Image out;
  out.width = static_cast<int>(ci.image_width);
  out.height = static_cast<int>(ci.image_height);
  if (comps == 3) {
    out.pixels = std::move(raw);
  } else {
    const size_t n = static_cast<size_t>(out.width) * out.height;
    out.pixels.resize(n * 3);
    for (size_t i = 0; i < n; ++i) out.pixels[3 * i] = out.pixels[3 * i + 1] = out.pixels[3 * i + 2] = raw[i];
  }
  return out;
}

#endif  // SPX_IMAGE_JPEG

// ---------------------------------------------------------------------------------------------
// Bicubic resampling, after Pillow's src/libImaging/Resample.c (Pillow is under the MIT-CMU / HPND
// licence; this is a re-implementation of its algorithm, not a copy). For each output index the
// taps are the input samples within `support` of the output's centre; their weights are the
// cubic convolution kernel (a = -0.5) in double, divided by their sum, then rounded to 22-bit
// fixed point. A pass accumulates in int32 from 1 << 21 and clips (sum >> 22) to 0..255 into a
// uint8 image; a pass whose size is unchanged is skipped, and the order of the two passes is
// Pillow 13's (resize_bicubic).

constexpr int kPrecisionBits = 32 - 8 - 2;

double cubic(double x) {
  const double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

struct Taps {
  int ksize = 0;               // the stride of `weights`
  std::vector<int> first;      // the first input index of output i
  std::vector<int> count;      // how many inputs from there
  std::vector<int32_t> weights;  // [out, ksize], fixed point
};

Taps cubic_taps(int in_size, int out_size) {
  Taps t;
  // Pillow's box is float (0, 0, w, h): scale = (double)(in1 - in0) / out
  const double scale = static_cast<double>(static_cast<float>(in_size)) / out_size;
  const double filterscale = scale < 1.0 ? 1.0 : scale;
  const double support = 2.0 * filterscale;
  t.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  t.first.resize(out_size);
  t.count.resize(out_size);
  t.weights.assign(static_cast<size_t>(out_size) * t.ksize, 0);
  std::vector<double> k(t.ksize);
  const double inv = 1.0 / filterscale;
  for (int i = 0; i < out_size; ++i) {
    const double center = 0.0 + (i + 0.5) * scale;
    int lo = static_cast<int>(center - support + 0.5);  // truncation, as C's (int)
    if (lo < 0) lo = 0;
    int hi = static_cast<int>(center + support + 0.5);
    if (hi > in_size) hi = in_size;
    const int n = hi - lo;
    double sum = 0.0;
    for (int j = 0; j < n; ++j) {
      const double w = cubic(((j + lo) - center + 0.5) * inv);
      k[j] = w;
      sum += w;
    }
    int32_t* out = &t.weights[static_cast<size_t>(i) * t.ksize];
    for (int j = 0; j < n; ++j) {
      double w = k[j];
      if (sum != 0.0) w /= sum;
      const double f = w * (1 << kPrecisionBits);
      out[j] = static_cast<int32_t>(w < 0 ? -0.5 + f : 0.5 + f);
    }
    t.first[i] = lo;
    t.count[i] = n;
  }
  return t;
}

inline uint8_t clip8(int32_t acc) {
  const int32_t v = acc >> kPrecisionBits;  // arithmetic shift, as Pillow's table lookup assumes
  return static_cast<uint8_t>(v < 0 ? 0 : v > 255 ? 255 : v);
}

// The row (horizontal) pass over `count` rows of `in` from `first`: out_width = cols' size.
Rgb8Image resample_rows(const Rgb8Image& in, const Taps& cols, int first, int count) {
  const int out_width = static_cast<int>(cols.first.size());
  Rgb8Image out;
  out.width = out_width;
  out.height = count;
  out.pixels.resize(static_cast<size_t>(out_width) * count * 3);
  for (int y = 0; y < count; ++y) {
    const uint8_t* line = &in.pixels[static_cast<size_t>(y + first) * in.width * 3];
    uint8_t* o = &out.pixels[static_cast<size_t>(y) * out_width * 3];
    for (int x = 0; x < out_width; ++x) {
      const int32_t* k = &cols.weights[static_cast<size_t>(x) * cols.ksize];
      const uint8_t* p = line + static_cast<size_t>(cols.first[x]) * 3;
      int32_t r = 1 << (kPrecisionBits - 1), g = r, b = r;
      for (int j = 0; j < cols.count[x]; ++j) {
        r += p[3 * j] * k[j];
        g += p[3 * j + 1] * k[j];
        b += p[3 * j + 2] * k[j];
      }
      o[3 * x] = clip8(r);
      o[3 * x + 1] = clip8(g);
      o[3 * x + 2] = clip8(b);
    }
  }
  return out;
}

// The column (vertical) pass; `in` starts at input row `offset` (the rows a row pass kept).
Rgb8Image resample_columns(const Rgb8Image& in, const Taps& rows, int offset) {
  const int out_height = static_cast<int>(rows.first.size());
  Rgb8Image out;
  out.width = in.width;
  out.height = out_height;
  out.pixels.resize(static_cast<size_t>(out.width) * out_height * 3);
  const size_t stride = static_cast<size_t>(in.width) * 3;  // every channel of a row: the same taps
  std::vector<int32_t> acc(stride);
  for (int y = 0; y < out_height; ++y) {
    const int32_t* k = &rows.weights[static_cast<size_t>(y) * rows.ksize];
    std::fill(acc.begin(), acc.end(), 1 << (kPrecisionBits - 1));
    for (int j = 0; j < rows.count[y]; ++j) {  // integer sums: the order of the terms does not matter
      const uint8_t* line = &in.pixels[static_cast<size_t>(rows.first[y] - offset + j) * stride];
      const int32_t kj = k[j];
      for (size_t x = 0; x < stride; ++x) acc[x] += line[x] * kj;
    }
    uint8_t* o = &out.pixels[static_cast<size_t>(y) * stride];
    for (size_t x = 0; x < stride; ++x) o[x] = clip8(acc[x]);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// PPM (binary, P6, maxval 255), built in: the format with no decoder library, which every build of the
// runner takes (a cross build without libpng or libjpeg too; `device bench` converts an image to it on
// the host for such a build). The header is read as Pillow's PpmImagePlugin reads it: the magic, then
// width, height and maxval, each a token after whitespace, a `#` comment running to CR or LF; one
// whitespace byte after maxval, then the raster, rows top to bottom, R G B. Stricter than Pillow where
// Pillow's reading is surprising: a token must be decimal digits (Python's int() takes "+5" or "1_0"),
// a comment may not interrupt a token, and maxval must be 255 (Pillow rescales other maxvals).
bool ppm_space(int c) { return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r'; }

// The next header token (digits), its terminating whitespace byte consumed, as Pillow's _read_token.
int64_t ppm_token(const std::string& path, FILE* f, const char* what) {
  std::string tok;
  while (true) {
    const int c = std::fgetc(f);
    if (c == EOF) {
      if (tok.empty()) throw Error(path + ": truncated PPM (the header ends before its " + what + ")");
      break;
    }
    if (ppm_space(c)) {
      if (tok.empty()) continue;
      break;
    }
    if (c == '#') {
      if (!tok.empty()) throw Error(path + ": corrupt PPM header (a comment inside its " + what + ")");
      int d;
      do d = std::fgetc(f);
      while (d != EOF && d != '\r' && d != '\n');
      continue;
    }
    if (c < '0' || c > '9' || tok.size() >= 10)
      throw Error(path + ": corrupt PPM header (its " + what + " is not a number of up to 10 digits)");
    tok.push_back(static_cast<char>(c));
  }
  return std::stoll(tok);
}

Rgb8Image decode_ppm(const std::string& path, FILE* f) {  // past the magic "P6" and its whitespace byte
  const int64_t w = ppm_token(path, f, "width"), h = ppm_token(path, f, "height");
  const int64_t maxval = ppm_token(path, f, "maxval");
  if (maxval != 255)
    throw Error(path + ": a PPM of maxval " + std::to_string(maxval) + "; only 8-bit PPMs (maxval 255) are taken");
  check_pixels(path, w, h);
  const size_t bytes = static_cast<size_t>(w) * static_cast<size_t>(h) * 3;
  // a short file is refused before its raster is allocated (a 20-byte header could ask for 192 MB)
  const long at = std::ftell(f);
  if (at >= 0 && std::fseek(f, 0, SEEK_END) == 0) {
    const long end = std::ftell(f);
    if (std::fseek(f, at, SEEK_SET) != 0) throw Error(path + ": cannot read the PPM's pixels");
    if (end >= at && static_cast<size_t>(end - at) < bytes) throw Error(path + ": truncated PPM (the pixels end early)");
  }
  Rgb8Image out;
  out.width = static_cast<int>(w);
  out.height = static_cast<int>(h);
  out.pixels.resize(bytes);
  if (std::fread(out.pixels.data(), 1, out.pixels.size(), f) != out.pixels.size())
    throw Error(path + ": truncated PPM (the pixels end early)");
  return out;
}

}  // namespace

Rgb8Image decode_image(const std::string& path) {
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) throw Error(path + ": cannot open (" + std::strerror(errno) + ")");
  unsigned char sig[8] = {};
  const size_t got = std::fread(sig, 1, sizeof sig, f.get());
  if (got < sizeof sig && std::ferror(f.get())) throw Error(path + ": cannot read (" + std::strerror(errno) + ")");
  static const unsigned char kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (got == 8 && std::memcmp(sig, kPng, 8) == 0) {
#if SPX_IMAGE_PNG
    return decode_png(path, f.get());  // past the signature
#else
    throw Error(path + ": a PNG, and this runner was built without a PNG decoder (no libpng for its target)");
#endif
  }
  if (got >= 3 && sig[0] == 0xFF && sig[1] == 0xD8 && sig[2] == 0xFF) {
#if SPX_IMAGE_JPEG
    std::rewind(f.get());
    return decode_jpeg(path, f.get());
#else
    throw Error(path + ": a JPEG, and this runner was built without a JPEG decoder (no libjpeg-turbo 2.0+ for its "
                "target)");
#endif
  }
  if (got >= 3 && sig[0] == 'P' && sig[1] == '6' && ppm_space(sig[2])) {
    if (std::fseek(f.get(), 3, SEEK_SET) != 0) throw Error(path + ": cannot read (" + std::strerror(errno) + ")");
    return decode_ppm(path, f.get());
  }
  if (got >= 2 && sig[0] == 'P' && sig[1] >= '1' && sig[1] <= '5')
    throw Error(path + ": a PBM, PGM or plain PPM (P" + std::string(1, static_cast<char>(sig[1])) +
                "); of the Netpbm formats only binary PPM (P6) is taken");
  throw Error(path + ": not a PNG, JPEG or PPM image");
}

void ImagePreprocess::validate() const {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw Error("image processor: " + what);
  };
  need(patch_size >= 1 && patch_size <= 1024, "patch_size " + std::to_string(patch_size) + " is not in 1..1024");
  need(merge_size >= 1 && merge_size <= 64, "merge_size " + std::to_string(merge_size) + " is not in 1..64");
  need(temporal_patch_size >= 1 && temporal_patch_size <= 64,
       "temporal_patch_size " + std::to_string(temporal_patch_size) + " is not in 1..64");
  const int64_t kMax = int64_t{1} << 40;
  need(min_pixels >= 1 && min_pixels <= kMax, "min_pixels " + std::to_string(min_pixels) + " is not in 1..2^40");
  need(max_pixels >= 1 && max_pixels <= kMax, "max_pixels " + std::to_string(max_pixels) + " is not in 1..2^40");
  need(std::isfinite(rescale_factor), "rescale_factor is not finite");
  for (int c = 0; c < 3; ++c) {
    need(std::isfinite(image_mean[c]), "image_mean is not finite");
    need(std::isfinite(image_std[c]) && static_cast<float>(image_std[c]) != 0.0f, "image_std must be finite and nonzero");
  }
}

ResizedSize smart_resize(int64_t height, int64_t width, int64_t factor, int64_t min_pixels, int64_t max_pixels) {
  const double h = static_cast<double>(height), w = static_cast<double>(width), f = static_cast<double>(factor);
  const double ratio = static_cast<double>(std::max(height, width)) / static_cast<double>(std::min(height, width));
  if (ratio > 200) {
    char b[160];
    std::snprintf(b, sizeof b, "aspect ratio %.4g (%lldx%lld) is over 200, which the image processor refuses", ratio,
                  static_cast<long long>(width), static_cast<long long>(height));
    throw Error(b);
  }
  // Python: round(height / factor) * factor, round() being ties-to-even
  int64_t h_bar = static_cast<int64_t>(std::nearbyint(h / f)) * factor;
  int64_t w_bar = static_cast<int64_t>(std::nearbyint(w / f)) * factor;
  if (h_bar * w_bar > max_pixels) {
    const double beta = std::sqrt(static_cast<double>(height * width) / static_cast<double>(max_pixels));
    h_bar = std::max(factor, static_cast<int64_t>(std::floor(h / beta / f)) * factor);
    w_bar = std::max(factor, static_cast<int64_t>(std::floor(w / beta / f)) * factor);
  } else if (h_bar * w_bar < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / static_cast<double>(height * width));
    h_bar = static_cast<int64_t>(std::ceil(h * beta / f)) * factor;
    w_bar = static_cast<int64_t>(std::ceil(w * beta / f)) * factor;
  }
  if (h_bar < 1 || w_bar < 1 || h_bar > (1 << 20) || w_bar > (1 << 20) || h_bar * w_bar > (int64_t{1} << 32))
    throw Error("the image processor would resize to " + std::to_string(w_bar) + "x" + std::to_string(h_bar) +
                ", which is refused");
  return {static_cast<int>(h_bar), static_cast<int>(w_bar)};
}

Rgb8Image resize_bicubic(const Rgb8Image& in, int out_width, int out_height) {
  if (out_width < 1 || out_height < 1) throw Error("resize to an empty image");
  if (in.width < 1 || in.height < 1 || in.pixels.size() != static_cast<size_t>(in.width) * in.height * 3)
    throw Error("resize of an empty or inconsistent image");
  if (out_width == in.width && out_height == in.height) return in;  // Image.resize: a copy
  const bool horizontal = out_width != in.width;
  const bool vertical = out_height != in.height;
  // The order of the passes (it changes the result: the intermediate is rounded to uint8). Pillow
  // 13 (python-pillow/Pillow#9549) resamples columns first when the height loses more than twice
  // as many pixels as the width does; before that, and otherwise, rows first.
  const bool columns_first =
      in.height > out_height && (in.height - out_height) > (in.width - out_width) * 2;
  if (columns_first) {
    Rgb8Image tmp = resample_columns(in, cubic_taps(in.height, out_height), 0);
    return horizontal ? resample_rows(tmp, cubic_taps(in.width, out_width), 0, out_height) : tmp;
  }
  Taps rows = cubic_taps(in.height, out_height);
  if (!horizontal) return resample_columns(in, rows, 0);
  // only the input rows the column pass reads go through the row pass
  const int row_first = rows.first[0];
  const int row_last = rows.first[out_height - 1] + rows.count[out_height - 1];
  Rgb8Image tmp = resample_rows(in, cubic_taps(in.width, out_width), row_first, row_last - row_first);
  return vertical ? resample_columns(tmp, rows, row_first) : tmp;
}

PixelValues preprocess_image(const Rgb8Image& image, const ImagePreprocess& p) {
  p.validate();
  if (image.width < 1 || image.height < 1 ||
      image.pixels.size() != static_cast<size_t>(image.width) * image.height * 3)
    throw Error("image processor: an empty or inconsistent image");
  const int64_t factor = static_cast<int64_t>(p.patch_size) * p.merge_size;
  Rgb8Image fixed;
  const Rgb8Image* src = &image;
  if (p.fixed_height > 0 && p.fixed_width > 0) {  // a bundle's size first (export/images.py)
    fixed = resize_bicubic(image, p.fixed_width, p.fixed_height);
    src = &fixed;
  }
  const ResizedSize rs = smart_resize(src->height, src->width, factor, p.min_pixels, p.max_pixels);
  const Rgb8Image resized = resize_bicubic(*src, rs.width, rs.height);

  // rescale then normalize, as numpy does them: (float32)(x * factor in double), then float32 maths
  float lut[3][256];
  for (int c = 0; c < 3; ++c) {
    const float mean = static_cast<float>(p.image_mean[c]), sd = static_cast<float>(p.image_std[c]);
    for (int x = 0; x < 256; ++x) {
      const float v = static_cast<float>(static_cast<double>(x) * p.rescale_factor);
      lut[c][x] = (v - mean) / sd;
    }
  }

  const int P = p.patch_size, M = p.merge_size, T = p.temporal_patch_size;
  PixelValues out;
  out.height = rs.height;
  out.width = rs.width;
  out.grid_t = 1;
  out.grid_h = rs.height / P;
  out.grid_w = rs.width / P;
  out.rows = static_cast<int64_t>(out.grid_h) * out.grid_w;
  out.cols = static_cast<int64_t>(3) * T * P * P;
  out.values.resize(static_cast<size_t>(out.rows * out.cols));
  // rows: merge blocks in raster order, raster order inside a block; columns: channel, frame
  // (the image repeated), patch row, patch column
  const int bh = out.grid_h / M, bw = out.grid_w / M;
  float* dst = out.values.data();
  for (int by = 0; by < bh; ++by)
    for (int bx = 0; bx < bw; ++bx)
      for (int my = 0; my < M; ++my)
        for (int mx = 0; mx < M; ++mx) {
          const int y0 = (by * M + my) * P, x0 = (bx * M + mx) * P;
          for (int c = 0; c < 3; ++c) {
            float* frame = dst;
            for (int py = 0; py < P; ++py) {
              const uint8_t* line = &resized.pixels[(static_cast<size_t>(y0 + py) * rs.width + x0) * 3 + c];
              for (int px = 0; px < P; ++px) *dst++ = lut[c][line[3 * px]];
            }
            for (int t = 1; t < T; ++t) {
              std::memcpy(dst, frame, sizeof(float) * P * P);
              dst += static_cast<size_t>(P) * P;
            }
          }
        }
  return out;
}

PixelValues load_image(const std::string& path, const ImagePreprocess& p) {
  const Rgb8Image image = decode_image(path);
  try {
    return preprocess_image(image, p);
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
}

}  // namespace spx
