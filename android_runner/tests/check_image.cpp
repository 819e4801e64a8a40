// check_image: the runner's image path (src/image.h) on one file, for tests/test_native_image.py,
// which compares its output with transformers' Qwen2VLImageProcessorPil.
//
//   check_image IMAGE [--patch 16] [--temporal 2] [--merge 2] [--min-pixels N] [--max-pixels N]
//                     [--mean a,b,c] [--std a,b,c] [--out FILE] [--decoded-out FILE] [--resized-out FILE]
//   check_image IMAGE --resize W,H --resized-out FILE     only the bicubic resize, to W x H
//   check_image IMAGE --fixed H,W ...                       a bundle's fixed image size first (ImagePreprocess)
//
// Prints one line, "grid T H W resized H W decoded H W" (grid in patches, sizes in pixels), and
// writes pixel_values [T*H*W, 3*temporal*patch*patch] as raw little-endian float32 to --out, the
// decoded image (RGB8, rows top to bottom) to --decoded-out and the resized one to --resized-out.
// Defaults: the Qwen3-VL checkpoints' (patch 16, temporal 2, merge 2, min 256*256, max 4096*4096,
// mean = std = 0.5). --resize prints "resized H W". A refusal is "check_image: error: <msg>" on stderr, exit 1.
//
// Build (host): g++ -std=c++17 -O2 -ffp-contract=off -I android_runner/src android_runner/tests/check_image.cpp
//   android_runner/src/image.cpp -lpng -ljpeg -o check_image
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "common.h"
#include "tool_main.h"
#include "image.h"

namespace {

int64_t parse_int(const std::string& opt, const std::string& s) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || errno != 0 || v < 1) throw spx::Error(opt + " " + s + ": not a positive integer");
  return v;
}

void parse_triple(const std::string& opt, const std::string& s, double out[3]) {
  size_t pos = 0;
  for (int i = 0; i < 3; ++i) {
    const size_t comma = s.find(',', pos);
    if ((i < 2) != (comma != std::string::npos)) throw spx::Error(opt + " " + s + ": three comma-separated numbers");
    const std::string part = s.substr(pos, i < 2 ? comma - pos : std::string::npos);
    errno = 0;
    char* end = nullptr;
    out[i] = std::strtod(part.c_str(), &end);  // as Python's float(): then rounded to float32 where used
    if (part.empty() || *end != '\0' || errno != 0) throw spx::Error(opt + " " + s + ": three comma-separated numbers");
    pos = comma + 1;
  }
}

void write_file(const std::string& path, const void* data, size_t n) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw spx::Error(path + ": cannot create (" + std::strerror(errno) + ")");
  const size_t put = n ? std::fwrite(data, 1, n, f) : 0;
  if (std::fclose(f) != 0 || put != n) throw spx::Error(path + ": write failed");
}

int run(int argc, char** argv) {
  spx::ImagePreprocess p;
  std::string image, out, decoded_out, resized_out;
  int64_t resize_w = 0, resize_h = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--", 0) != 0) {
      if (!image.empty()) throw spx::Error("one image only (got " + image + " and " + a + ")");
      image = a;
      continue;
    }
    if (i + 1 >= argc) throw spx::Error(a + ": needs a value");
    const std::string v = argv[++i];
    if (a == "--patch") p.patch_size = static_cast<int>(parse_int(a, v));
    else if (a == "--temporal") p.temporal_patch_size = static_cast<int>(parse_int(a, v));
    else if (a == "--merge") p.merge_size = static_cast<int>(parse_int(a, v));
    else if (a == "--min-pixels") p.min_pixels = parse_int(a, v);
    else if (a == "--max-pixels") p.max_pixels = parse_int(a, v);
    else if (a == "--mean") parse_triple(a, v, p.image_mean);
    else if (a == "--std") parse_triple(a, v, p.image_std);
    else if (a == "--out") out = v;
    else if (a == "--decoded-out") decoded_out = v;
    else if (a == "--resized-out") resized_out = v;
    else if (a == "--fixed") {
      const size_t comma = v.find(',');
      if (comma == std::string::npos) throw spx::Error(a + " " + v + ": H,W");
      p.fixed_height = static_cast<int>(parse_int(a, v.substr(0, comma)));
      p.fixed_width = static_cast<int>(parse_int(a, v.substr(comma + 1)));
    }
    else if (a == "--resize") {
      const size_t comma = v.find(',');
      if (comma == std::string::npos) throw spx::Error(a + " " + v + ": W,H");
      resize_w = parse_int(a, v.substr(0, comma));
      resize_h = parse_int(a, v.substr(comma + 1));
      if (resize_w > 100000 || resize_h > 100000) throw spx::Error(a + " " + v + ": too large");
    }
    else throw spx::Error("unknown option " + a);
  }
  if (image.empty()) throw spx::Error("usage: check_image IMAGE [--patch N ...] [--out FILE]");
  p.validate();

  // load_image's steps, one at a time so that each stage can be written out
  const spx::Rgb8Image decoded = spx::decode_image(image);
  if (resize_w) {
    const spx::Rgb8Image r = spx::resize_bicubic(decoded, static_cast<int>(resize_w), static_cast<int>(resize_h));
    std::printf("resized %d %d\n", r.height, r.width);
    if (!resized_out.empty()) write_file(resized_out, r.pixels.data(), r.pixels.size());
    return 0;
  }
  spx::PixelValues pv;
  try {
    pv = spx::preprocess_image(decoded, p);
  } catch (const spx::Error& e) {
    throw spx::Error(image + ": " + e.what());
  }
  std::printf("grid %d %d %d resized %d %d decoded %d %d\n", pv.grid_t, pv.grid_h, pv.grid_w, pv.height, pv.width,
              decoded.height, decoded.width);
  if (!out.empty()) write_file(out, pv.values.data(), pv.values.size() * sizeof(float));
  if (!decoded_out.empty()) write_file(decoded_out, decoded.pixels.data(), decoded.pixels.size());
  if (!resized_out.empty()) {
    const spx::Rgb8Image r = spx::resize_bicubic(decoded, pv.width, pv.height);
    write_file(resized_out, r.pixels.data(), r.pixels.size());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return spx_tool::main("check_image", run, argc, argv); }
