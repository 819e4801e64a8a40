// Images for a vision-language bundle: decoding a PNG, JPEG or PPM file into RGB8, and the Qwen2-VL /
// Qwen3-VL image processor on it (transformers' Qwen2VLImageProcessorPil, the class the toolkit
// loads: toolkit/models/loader.py), to the last bit of its pixel_values and image_grid_thw.
//
// The reference is `processor(images=[Image.open(path).convert("RGB")])`:
//   1. convert("RGB") of what Pillow decodes (no EXIF rotation, as toolkit/traces/capture.py);
//   2. smart_resize to multiples of patch_size * merge_size, then Pillow's bicubic Image.resize;
//   3. x * rescale_factor in double, rounded to float32, then (v - mean) / std in float32;
//   4. patches in merge-block order, the frame repeated temporal_patch_size times.
// tests/test_native_image.py checks that pixel_values are bit-identical.
//
// What decode_image takes, and what it refuses (each refusal one spx::Error line naming the file):
//   - Kinds: PNG, JPEG and binary PPM (P6), recognised by their signature (not the name). Anything else:
//     "not a PNG, JPEG or PPM image". Animated PNG: the default image only, as Pillow opens it.
//   - PPM: built in (no library), so every build takes it, a cross build without libpng and libjpeg
//     too: P6 with maxval 255 only, its header read as Pillow reads it (image.cpp: decode_ppm says
//     where it is stricter). Other Netpbm kinds (P1-P5) are refused by name.
//   - PNG: every colour type and bit depth, interlaced or not, converted as PIL's convert("RGB"):
//     grey is replicated (1/2/4-bit grey scaled to 0..255, x * 255 / (2^d - 1)); 16-bit grey is
//     clipped to 255 (PIL opens it as I;16 and clips); every other 16-bit sample keeps its high byte;
//     a palette index maps through PLTE (an index past PLTE's end is black, as in Pillow); alpha and
//     tRNS are dropped without compositing; gAMA, cHRM, iCCP and sBIT are ignored.
//   - JPEG: libjpeg-turbo with the library's defaults (JDCT_ISLOW, fancy upsampling), which is what
//     Pillow asks for when draft() is not called: grey (1 component) or YCbCr/RGB (3 components),
//     baseline, progressive or arithmetic-coded. CMYK and YCCK (4 components) are refused.
//   - Truncated or corrupt: any libpng or libjpeg error, and image data that ends early (Pillow
//     refuses these too, unless LOAD_TRUNCATED_IMAGES). A PNG's IDAT checksum is not checked (Pillow
//     does not check it; the chunks before it are checked). After a PNG's last row nothing is read (a
//     missing IEND is taken); a JPEG without its EOI marker is refused as truncated (libjpeg reads
//     ahead for the last row's bits; Pillow refuses it too).
//   - Size: width * height over kMaxImagePixels, or a PNG whose stored samples would take over
//     kMaxImageBytes (16-bit RGBA: 8 bytes a pixel), is refused from the header (IHDR, SOF), before any
//     pixel memory is allocated. Peak memory is then at most kMaxImageBytes of samples plus 3 bytes a
//     pixel of RGB8 (a progressive JPEG: libjpeg's coefficient buffer, about 2 bytes a pixel, instead
//     of the samples), plus the resize's intermediate.
//   - The resize's fixed-point weights are computed in double with no fused multiply-add: the
//     project compiles with -ffp-contract=off (CMakeLists.txt), which the bit-identical results need. There is no smallest size: the processor takes 1x1 (smart_resize
//     scales it up to about min_pixels), so this does too.
// preprocess_image refuses an aspect ratio (long side / short side) over 200, as smart_resize does.
//
// The decoders are compiled in where libpng's and libjpeg's headers are found (SPX_IMAGE_PNG,
// SPX_IMAGE_JPEG, 1 or 0; -D to override); without one, decoding that kind is a refusal. Linking a
// decoder needs -lpng / -ljpeg. The PPM reader, resizing and the processor need neither.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace spx {

// 64 megapixels decoded: 192 MiB of RGB8, plus the resize's intermediate.
constexpr int64_t kMaxImagePixels = 64LL * 1000 * 1000;
// A PNG's stored samples (before the RGB8 conversion): 256 MiB, e.g. 32 megapixels of 16-bit RGBA.
constexpr uint64_t kMaxImageBytes = 256ULL << 20;

// An 8-bit RGB image, rows top to bottom, pixels R G B.
struct Rgb8Image {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> pixels;  // height * width * 3
};

// The PNG, JPEG or PPM at `path` as PIL's Image.open(path).convert("RGB") gives it.
Rgb8Image decode_image(const std::string& path);

// The processor's settings: preprocessor_config.json's keys (min_pixels = size.shortest_edge,
// max_pixels = size.longest_edge). Defaults: the Qwen3-VL checkpoints'.
struct ImagePreprocess {
  int patch_size = 16;
  int temporal_patch_size = 2;
  int merge_size = 2;
  int64_t min_pixels = 256 * 256;
  int64_t max_pixels = 4096LL * 4096;
  double rescale_factor = 1.0 / 255.0;
  double image_mean[3] = {0.5, 0.5, 0.5};  // rounded to float32 where used, as numpy does
  double image_std[3] = {0.5, 0.5, 0.5};
  // A bundle's fixed image size (its manifest's graphs.vision.image_size), 0 if none: the image is first
  // resized to exactly this (bicubic), as the toolkit does before the processor, whose smart_resize then
  // keeps it.
  int fixed_height = 0, fixed_width = 0;

  // Refuses (spx::Error naming the key) a size or factor below 1 or absurdly large, a zero std.
  void validate() const;
};

struct ResizedSize {
  int height = 0;
  int width = 0;
};

// transformers' smart_resize: both sides multiples of `factor`, the area near [min, max]_pixels
// (the min branch rounds up and may pass max_pixels, as the Python does). The same double
// operations in the same order; Python's round() is ties-to-even. Throws spx::Error (no file
// name) for an aspect ratio over 200.
ResizedSize smart_resize(int64_t height, int64_t width, int64_t factor, int64_t min_pixels, int64_t max_pixels);

// Pillow's Image.resize(..., BICUBIC) of an RGB image: the same image when the size is unchanged.
// The passes run in Pillow 13's order (columns first when the height loses more than twice as many
// pixels as the width; Pillow 12 and older always resample rows first, which differs there).
Rgb8Image resize_bicubic(const Rgb8Image& in, int out_width, int out_height);

// The processor's output for one image.
struct PixelValues {
  int grid_t = 1, grid_h = 0, grid_w = 0;  // image_grid_thw: patches (temporal, rows, columns)
  int height = 0, width = 0;               // the resized image
  int64_t rows = 0;                        // grid_t * grid_h * grid_w
  int64_t cols = 0;                        // 3 * temporal_patch_size * patch_size^2
  std::vector<float> values;               // pixel_values [rows, cols]
};

// smart_resize + resize + rescale + normalize + patches. Throws spx::Error (no file name).
PixelValues preprocess_image(const Rgb8Image& image, const ImagePreprocess& p);

// decode_image + preprocess_image; every refusal names `path`.
PixelValues load_image(const std::string& path, const ImagePreprocess& p);

}  // namespace spx
