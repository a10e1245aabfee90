// Tests of the IDX reader (core/data/idx.h), LoadDataset, GatherBatch and the Sampler
// (core/data/dataset.h).
// Over 600 lines: each malformed-file case builds its own bytes inline, so a failure reads alone.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "core/base/error.h"
#include "core/data/dataset.h"
#include "core/data/idx.h"

namespace pipesgd::data {
namespace {

using Bytes = std::vector<uint8_t>;

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it.
class TempDir {
 public:
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
                        "/pipesgd_data_test.XXXXXX";
    char* made = ::mkdtemp(templ.data());
    if (made == nullptr) throw std::runtime_error("mkdtemp failed for " + templ);
    path_ = made;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void WriteFile(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  ASSERT_TRUE(out.good()) << path;
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

void WriteText(const std::string& path, const std::string& text) {
  WriteFile(path, Bytes(text.begin(), text.end()));
}

Bytes ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void PutBigEndian32(Bytes* out, uint32_t v) {
  out->push_back(uint8_t(v >> 24));
  out->push_back(uint8_t(v >> 16));
  out->push_back(uint8_t(v >> 8));
  out->push_back(uint8_t(v));
}

// An IDX file: magic, dims, data.
Bytes Idx(uint32_t magic, std::initializer_list<uint32_t> dims, const Bytes& data) {
  Bytes out;
  PutBigEndian32(&out, magic);
  for (uint32_t d : dims) PutBigEndian32(&out, d);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

Bytes ImagesIdx(uint32_t count, uint32_t rows, uint32_t cols, const Bytes& pixels) {
  return Idx(0x00000803, {count, rows, cols}, pixels);
}

Bytes LabelsIdx(const Bytes& labels) {
  return Idx(0x00000801, {static_cast<uint32_t>(labels.size())}, labels);
}

// A single-member gzip file of `data` (zlib deflate with the gzip wrapper).
Bytes Gzip(const Bytes& data) {
  z_stream zs{};
  EXPECT_EQ(deflateInit2(&zs, Z_BEST_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY),
            Z_OK);
  Bytes out(deflateBound(&zs, data.size()) + 64);
  zs.next_in = const_cast<Bytes::value_type*>(data.data());
  zs.avail_in = static_cast<uInt>(data.size());
  zs.next_out = out.data();
  zs.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&zs, Z_FINISH), Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

// Deterministic pseudo-random bytes (incompressible enough that gzip output is sizable).
Bytes Pattern(size_t n, uint32_t seed) {
  Bytes out(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    out[i] = uint8_t(x >> 24);
  }
  return out;
}

// Runs fn, expects a pipesgd::Error with `code` whose message contains every string of `parts`.
void ExpectError(const std::function<void()>& fn, ErrorCode code,
                 std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "no pipesgd::Error thrown (expected " << ErrorCodeName(code) << ")";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.code(), code) << "got " << ErrorCodeName(e.code()) << ": " << msg;
    for (const std::string& part : parts) {
      EXPECT_NE(msg.find(part), std::string::npos) << "message lacks \"" << part << "\": " << msg;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The real Fashion-MNIST files.

std::string FashionMnistDir() {
  const char* env = std::getenv("PIPESGD_FASHION_MNIST_DIR");
  return env != nullptr && *env != '\0' ? env : "/usr/share/datasets/fashion-mnist";
}

#define REQUIRE_FASHION_MNIST()                                                                 \
  do {                                                                                          \
    if (!std::filesystem::exists(FashionMnistDir() + "/train-labels-idx1-ubyte.gz"))            \
      GTEST_SKIP() << "Fashion-MNIST not installed in " << FashionMnistDir()                    \
                   << " (set PIPESGD_FASHION_MNIST_DIR)";                                       \
  } while (0)

std::array<int, 10> LabelCounts(const Bytes& labels) {
  std::array<int, 10> counts{};
  for (uint8_t l : labels) ++counts.at(l);
  return counts;
}

uint64_t ImageSum(const IdxImages& images, size_t i) {
  const size_t n = images.rows * images.cols;
  uint64_t sum = 0;
  for (size_t j = 0; j < n; ++j) sum += images.pixels[i * n + j];
  return sum;
}

// Ground truth below was read once with Python's gzip module, independently of this reader:
//   l = gzip.open('train-labels-idx1-ubyte.gz').read(); list(l[8:18]); Counter(l[8:])
//   im = gzip.open('train-images-idx3-ubyte.gz').read(); sum(im[16:16+784]); im[16+14*28+14]
// (same for t10k).
TEST(FashionMnist, TrainSet) {
  REQUIRE_FASHION_MNIST();
  const std::string dir = FashionMnistDir();
  const IdxImages images = ReadIdxImages(dir + "/train-images-idx3-ubyte.gz");
  EXPECT_EQ(images.count, 60000u);
  EXPECT_EQ(images.rows, 28u);
  EXPECT_EQ(images.cols, 28u);
  ASSERT_EQ(images.pixels.size(), 60000u * 28 * 28);
  EXPECT_EQ(ImageSum(images, 0), 76247u);
  EXPECT_EQ(images.pixels[14 * 28 + 14], 217);
  EXPECT_EQ(*std::max_element(images.pixels.begin(), images.pixels.begin() + 784), 255);

  const Bytes labels = ReadIdxLabels(dir + "/train-labels-idx1-ubyte.gz", 10);
  ASSERT_EQ(labels.size(), 60000u);
  EXPECT_EQ(Bytes(labels.begin(), labels.begin() + 10), (Bytes{9, 0, 0, 3, 0, 2, 7, 2, 5, 5}));
  EXPECT_EQ(labels.back(), 5);
  std::array<int, 10> expected;
  expected.fill(6000);
  EXPECT_EQ(LabelCounts(labels), expected);
}

TEST(FashionMnist, TestSet) {
  REQUIRE_FASHION_MNIST();
  const std::string dir = FashionMnistDir();
  const IdxImages images = ReadIdxImages(dir + "/t10k-images-idx3-ubyte.gz");
  EXPECT_EQ(images.count, 10000u);
  EXPECT_EQ(images.rows, 28u);
  EXPECT_EQ(images.cols, 28u);
  ASSERT_EQ(images.pixels.size(), 10000u * 28 * 28);
  EXPECT_EQ(ImageSum(images, 0), 33456u);
  EXPECT_EQ(images.pixels[14 * 28 + 14], 110);

  const Bytes labels = ReadIdxLabels(dir + "/t10k-labels-idx1-ubyte.gz", 10);
  ASSERT_EQ(labels.size(), 10000u);
  EXPECT_EQ(Bytes(labels.begin(), labels.begin() + 10), (Bytes{9, 2, 1, 1, 6, 1, 4, 6, 5, 7}));
  std::array<int, 10> expected;
  expected.fill(1000);
  EXPECT_EQ(LabelCounts(labels), expected);
}

TEST(FashionMnist, LoadDatasetWithLimit) {
  REQUIRE_FASHION_MNIST();
  const std::string dir = FashionMnistDir();
  const Dataset ds = LoadDataset(dir + "/t10k-images-idx3-ubyte.gz",
                                 dir + "/t10k-labels-idx1-ubyte.gz", 10, 1000);
  EXPECT_EQ(ds.count, 1000u);
  EXPECT_EQ(ds.features, 784u);
  EXPECT_EQ(ds.num_classes, 10);
  EXPECT_EQ(ds.pixels.size(), 1000u * 784);
  ASSERT_EQ(ds.labels.size(), 1000u);
  EXPECT_EQ(ds.labels[0], 9);
  EXPECT_EQ(ds.pixels[14 * 28 + 14], 110);

  // The real labels file handed to the images reader, and the other way round.
  ExpectError([&] { ReadIdxImages(dir + "/t10k-labels-idx1-ubyte.gz"); }, ErrorCode::kDataLoss,
              {dir + "/t10k-labels-idx1-ubyte.gz", "is a labels file", "0x00000801",
               "0x00000803"});
  ExpectError([&] { ReadIdxLabels(dir + "/t10k-images-idx3-ubyte.gz", 10); },
              ErrorCode::kDataLoss,
              {dir + "/t10k-images-idx3-ubyte.gz", "is an images file", "0x00000803",
               "0x00000801"});
}

// ---------------------------------------------------------------------------------------------
// Round trips.

TEST(IdxReader, RoundTripRawAndGzip) {
  TempDir tmp;
  const Bytes pixels = Pattern(3 * 4 * 5, 1);
  const Bytes labels = {0, 9, 4};
  const Bytes images_file = ImagesIdx(3, 4, 5, pixels);
  const Bytes labels_file = LabelsIdx(labels);
  WriteFile(tmp.File("img"), images_file);
  WriteFile(tmp.File("lab"), labels_file);
  WriteFile(tmp.File("img.gz"), Gzip(images_file));
  WriteFile(tmp.File("lab.gz"), Gzip(labels_file));
  ASSERT_EQ(ReadFile(tmp.File("img.gz")).at(0), 0x1f);

  for (const std::string suffix : {"", ".gz"}) {
    SCOPED_TRACE("suffix '" + suffix + "'");
    const IdxImages images = ReadIdxImages(tmp.File("img" + suffix));
    EXPECT_EQ(images.count, 3u);
    EXPECT_EQ(images.rows, 4u);
    EXPECT_EQ(images.cols, 5u);
    EXPECT_EQ(images.pixels, pixels);
    EXPECT_EQ(ReadIdxLabels(tmp.File("lab" + suffix), 10), labels);
  }
}

TEST(IdxReader, LargerGzipRoundTrip) {
  // Several zlib buffers' worth, to exercise the chunked read.
  TempDir tmp;
  const Bytes pixels = Pattern(500 * 28 * 28, 2);
  WriteFile(tmp.File("img.gz"), Gzip(ImagesIdx(500, 28, 28, pixels)));
  const IdxImages images = ReadIdxImages(tmp.File("img.gz"));
  EXPECT_EQ(images.count, 500u);
  EXPECT_EQ(images.pixels, pixels);
}

TEST(IdxReader, EmptyLabelsFile) {
  TempDir tmp;
  WriteFile(tmp.File("lab"), LabelsIdx({}));
  EXPECT_TRUE(ReadIdxLabels(tmp.File("lab"), 10).empty());
}

// ---------------------------------------------------------------------------------------------
// Bad inputs.

TEST(IdxReader, MissingFile) {
  TempDir tmp;
  const std::string path = tmp.File("nope-images.gz");
  ExpectError([&] { ReadIdxImages(path); }, ErrorCode::kNotFound,
              {path, "No such file or directory"});
  ExpectError([&] { ReadIdxLabels(path, 10); }, ErrorCode::kNotFound,
              {path, "No such file or directory"});
}

TEST(IdxReader, HtmlPage) {
  TempDir tmp;
  const std::string path = tmp.File("images.gz");  // a download that returned an error page
  WriteText(path, "<!DOCTYPE html>\n<html><body>404 Not Found</body></html>\n");
  ExpectError([&] { ReadIdxImages(path); }, ErrorCode::kDataLoss,
              {path, "not an IDX file (neither gzip nor IDX magic)", "3c 21 44 4f", "'<!DO'",
               "expected IDX magic 00 00 08 03 for images"});
  ExpectError([&] { ReadIdxLabels(path, 10); }, ErrorCode::kDataLoss,
              {path, "3c 21 44 4f", "expected IDX magic 00 00 08 01 for labels"});

  const std::string gz = tmp.File("html.gz");
  const std::string html = "<html>oops</html>";
  WriteFile(gz, Gzip(Bytes(html.begin(), html.end())));
  ExpectError([&] { ReadIdxImages(gz); }, ErrorCode::kDataLoss,
              {gz, "gzip content is not an IDX file", "3c 68 74 6d", "'<htm'",
               "00 00 08 03"});
}

TEST(IdxReader, EmptyAndTinyFiles) {
  TempDir tmp;
  WriteFile(tmp.File("empty"), {});
  ExpectError([&] { ReadIdxImages(tmp.File("empty")); }, ErrorCode::kDataLoss,
              {tmp.File("empty"), "only 0 bytes", "00 00 08 03"});
  // A valid magic and half a header.
  WriteFile(tmp.File("short"), {0, 0, 8, 3, 0, 0, 0, 1, 0});
  ExpectError([&] { ReadIdxImages(tmp.File("short")); }, ErrorCode::kDataLoss,
              {tmp.File("short"), "truncated IDX header", "9 bytes", "needs 16"});
  // Gzip magic but too short to be gzip.
  WriteFile(tmp.File("tiny.gz"), {0x1f, 0x8b, 8, 0});
  ExpectError([&] { ReadIdxImages(tmp.File("tiny.gz")); }, ErrorCode::kDataLoss,
              {tmp.File("tiny.gz"), "4 bytes", "18"});
}

TEST(IdxReader, WrongMagic) {
  TempDir tmp;
  // float32 elements.
  WriteFile(tmp.File("float"), Idx(0x00000D03, {1, 1, 1}, {0, 0, 0, 0}));
  ExpectError([&] { ReadIdxImages(tmp.File("float")); }, ErrorCode::kDataLoss,
              {tmp.File("float"), "unsupported IDX element type 0x0d (float32)", "0x00000d03",
               "0x00000803"});
  // Unsigned bytes, but 2 dimensions.
  WriteFile(tmp.File("2d"), Idx(0x00000802, {2, 2}, {1, 2, 3, 4}));
  ExpectError([&] { ReadIdxImages(tmp.File("2d")); }, ErrorCode::kDataLoss,
              {tmp.File("2d"), "2 dimensions", "0x00000802", "0x00000803"});
  ExpectError([&] { ReadIdxLabels(tmp.File("2d"), 10); }, ErrorCode::kDataLoss,
              {tmp.File("2d"), "2 dimensions", "0x00000802", "0x00000801"});
  // Nonzero first bytes.
  WriteFile(tmp.File("junk"), {0x12, 0x34, 0x08, 0x03, 0, 0, 0, 0});
  ExpectError([&] { ReadIdxImages(tmp.File("junk")); }, ErrorCode::kDataLoss,
              {tmp.File("junk"), "not an IDX file", "12 34 08 03", "00 00 08 03"});
}

TEST(IdxReader, LabelsFileAsImagesAndViceVersa) {
  TempDir tmp;
  WriteFile(tmp.File("lab"), LabelsIdx({1, 2, 3}));
  WriteFile(tmp.File("img.gz"), Gzip(ImagesIdx(1, 2, 2, {1, 2, 3, 4})));
  ExpectError([&] { ReadIdxImages(tmp.File("lab")); }, ErrorCode::kDataLoss,
              {tmp.File("lab"), "is a labels file (1 dimension, magic 0x00000801)",
               "images file (3 dimensions, magic 0x00000803) was expected"});
  ExpectError([&] { ReadIdxLabels(tmp.File("img.gz"), 10); }, ErrorCode::kDataLoss,
              {tmp.File("img.gz"), "is an images file (3 dimensions, magic 0x00000803)",
               "labels file (1 dimension, magic 0x00000801) was expected"});
}

TEST(IdxReader, TruncatedAndTooLongRaw) {
  TempDir tmp;
  const Bytes file = ImagesIdx(10, 2, 3, Pattern(60, 3));  // 16 + 60 = 76 bytes
  ASSERT_EQ(file.size(), 76u);
  WriteFile(tmp.File("short"), Bytes(file.begin(), file.begin() + 70));
  ExpectError([&] { ReadIdxImages(tmp.File("short")); }, ErrorCode::kDataLoss,
              {tmp.File("short"), "file is 70 bytes", "declares 76 bytes", "10x2x3",
               "truncated by 6 bytes"});
  Bytes longer = file;
  longer.insert(longer.end(), {1, 2, 3, 4, 5});
  WriteFile(tmp.File("long"), longer);
  ExpectError([&] { ReadIdxImages(tmp.File("long")); }, ErrorCode::kDataLoss,
              {tmp.File("long"), "file is 81 bytes", "declares 76 bytes", "too long by 5 bytes"});
  // Labels: 8-byte header.
  const Bytes labels = LabelsIdx({1, 2, 3, 4});  // 12 bytes
  WriteFile(tmp.File("lab"), Bytes(labels.begin(), labels.end() - 1));
  ExpectError([&] { ReadIdxLabels(tmp.File("lab"), 10); }, ErrorCode::kDataLoss,
              {tmp.File("lab"), "file is 11 bytes", "declares 12 bytes"});
}

TEST(IdxReader, AbsurdDims) {
  TempDir tmp;
  WriteFile(tmp.File("huge"), Idx(0x00000803, {0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF}, {}));
  ExpectError([&] { ReadIdxImages(tmp.File("huge")); }, ErrorCode::kDataLoss,
              {tmp.File("huge"), "4294967295x4294967295x4294967295",
               "79228162458924105385300197375", "17179869184", "2^34"});
  // Just over the limit: 2^18 * 2^8 * 2^9 = 2^35.
  WriteFile(tmp.File("big.gz"), Gzip(Idx(0x00000803, {1u << 18, 1u << 8, 1u << 9}, {})));
  ExpectError([&] { ReadIdxImages(tmp.File("big.gz")); }, ErrorCode::kDataLoss,
              {tmp.File("big.gz"), "34359738368", "2^34"});
  WriteFile(tmp.File("zero"), Idx(0x00000803, {5, 0, 28}, {}));
  ExpectError([&] { ReadIdxImages(tmp.File("zero")); }, ErrorCode::kDataLoss,
              {tmp.File("zero"), "5x0x28", "zero dimension"});
}

TEST(IdxReader, TruncatedGzip) {
  TempDir tmp;
  const Bytes file = ImagesIdx(100, 8, 8, Pattern(6400, 4));  // 6416 bytes uncompressed
  const Bytes gz = Gzip(file);
  ASSERT_GT(gz.size(), 1000u);

  // Cut in half: the trailer is gone, so ISIZE (the last 4 bytes) disagrees with the header.
  WriteFile(tmp.File("half.gz"), Bytes(gz.begin(), gz.begin() + gz.size() / 2));
  ExpectError([&] { ReadIdxImages(tmp.File("half.gz")); }, ErrorCode::kDataLoss,
              {tmp.File("half.gz"), "gzip trailer records", "declares 6416 bytes", "100x8x8"});

  // Cut out the middle but keep the real trailer: ISIZE agrees, the stream itself comes up
  // short or corrupt, found while reading.
  Bytes middle_cut(gz.begin(), gz.begin() + gz.size() / 2);
  middle_cut.insert(middle_cut.end(), gz.end() - 8, gz.end());
  WriteFile(tmp.File("cut.gz"), middle_cut);
  ExpectError([&] { ReadIdxImages(tmp.File("cut.gz")); }, ErrorCode::kDataLoss,
              {tmp.File("cut.gz"), "of 6416 expected uncompressed bytes"});

  // A bad CRC32 (all bytes present): caught by the read past the end.
  Bytes bad_crc = gz;
  bad_crc[bad_crc.size() - 8] ^= 0xff;
  WriteFile(tmp.File("crc.gz"), bad_crc);
  ExpectError([&] { ReadIdxImages(tmp.File("crc.gz")); }, ErrorCode::kDataLoss,
              {tmp.File("crc.gz"), "got 6416 of 6416", "incorrect data check"});

  // Two gzip members each of 6416 bytes: the last trailer says 6416, but more follows.
  Bytes twice = gz;
  twice.insert(twice.end(), gz.begin(), gz.end());
  WriteFile(tmp.File("twice.gz"), twice);
  ExpectError([&] { ReadIdxImages(tmp.File("twice.gz")); }, ErrorCode::kDataLoss,
              {tmp.File("twice.gz"),
               std::to_string(gz.size()) + " bytes follow the end of the gzip stream", "6416"});

  // The content split over two members (valid gzip, unsupported here): the first one ends early.
  const Bytes part1(file.begin(), file.begin() + 3000);
  const Bytes part2(file.begin() + 3000, file.end());
  Bytes split = Gzip(part1);
  const Bytes gz2 = Gzip(part2);
  split.insert(split.end(), gz2.begin(), gz2.end());
  WriteFile(tmp.File("split.gz"), split);
  // ISIZE is the last member's 3416 bytes: caught before reading.
  ExpectError([&] { ReadIdxImages(tmp.File("split.gz")); }, ErrorCode::kDataLoss,
              {tmp.File("split.gz"), "records 3416 uncompressed bytes", "declares 6416 bytes"});

  // Uncompressed content that goes on past the header's size, with a trailer (forged here)
  // that agrees with the header: caught by reading one byte past the end.
  Bytes longer_content = file;
  longer_content.insert(longer_content.end(), 10, 0xAB);
  Bytes forged = Gzip(longer_content);
  for (int i = 0; i < 4; ++i) forged[forged.size() - 4 + i] = uint8_t(6416u >> (8 * i));
  WriteFile(tmp.File("forged.gz"), forged);
  ExpectError([&] { ReadIdxImages(tmp.File("forged.gz")); }, ErrorCode::kDataLoss,
              {tmp.File("forged.gz"), "more than the 6416 uncompressed bytes"});

  // The uncompressed content longer than the header says (trailer agrees with the content).
  Bytes longer = file;
  longer.push_back(7);
  WriteFile(tmp.File("long.gz"), Gzip(longer));
  ExpectError([&] { ReadIdxImages(tmp.File("long.gz")); }, ErrorCode::kDataLoss,
              {tmp.File("long.gz"), "records 6417 uncompressed bytes", "declares 6416 bytes"});
}

TEST(IdxReader, LabelOutOfRange) {
  TempDir tmp;
  WriteFile(tmp.File("lab"), LabelsIdx({0, 9, 3, 10, 11}));
  ExpectError([&] { ReadIdxLabels(tmp.File("lab"), 10); }, ErrorCode::kDataLoss,
              {tmp.File("lab"), "label 10 at index 3", "[0, 9]", "num_classes 10"});
  EXPECT_EQ(ReadIdxLabels(tmp.File("lab"), 12), (Bytes{0, 9, 3, 10, 11}));
  ExpectError([&] { ReadIdxLabels(tmp.File("lab"), 0); }, ErrorCode::kInvalidArgument,
              {"num_classes"});
}

// ---------------------------------------------------------------------------------------------
// LoadDataset and GatherBatch.

TEST(LoadDataset, CountsMustAgree) {
  TempDir tmp;
  WriteFile(tmp.File("img"), ImagesIdx(10, 2, 2, Pattern(40, 5)));
  WriteFile(tmp.File("lab"), LabelsIdx(Bytes(9, 1)));
  ExpectError([&] { LoadDataset(tmp.File("img"), tmp.File("lab"), 10); }, ErrorCode::kDataLoss,
              {tmp.File("img"), tmp.File("lab"), "10 images", "9 labels"});
}

TEST(LoadDataset, ErrorsPropagateWithCode) {
  TempDir tmp;
  WriteFile(tmp.File("img"), ImagesIdx(2, 2, 2, Pattern(8, 5)));
  ExpectError([&] { LoadDataset(tmp.File("img"), tmp.File("missing"), 10); },
              ErrorCode::kNotFound, {tmp.File("missing")});
}

TEST(LoadDataset, LimitAndFeatures) {
  TempDir tmp;
  const Bytes pixels = Pattern(5 * 3 * 4, 6);
  const Bytes labels = {4, 3, 2, 1, 0};
  WriteFile(tmp.File("img.gz"), Gzip(ImagesIdx(5, 3, 4, pixels)));
  WriteFile(tmp.File("lab"), LabelsIdx(labels));

  const Dataset all = LoadDataset(tmp.File("img.gz"), tmp.File("lab"), 5);
  EXPECT_EQ(all.count, 5u);
  EXPECT_EQ(all.features, 12u);
  EXPECT_EQ(all.num_classes, 5);
  EXPECT_EQ(all.pixels, pixels);
  EXPECT_EQ(all.labels, labels);

  const Dataset first3 = LoadDataset(tmp.File("img.gz"), tmp.File("lab"), 5, 3);
  EXPECT_EQ(first3.count, 3u);
  EXPECT_EQ(first3.features, 12u);
  EXPECT_EQ(first3.pixels, Bytes(pixels.begin(), pixels.begin() + 36));
  EXPECT_EQ(first3.labels, (Bytes{4, 3, 2}));

  const Dataset more = LoadDataset(tmp.File("img.gz"), tmp.File("lab"), 5, 100);
  EXPECT_EQ(more.count, 5u);
  EXPECT_EQ(more.pixels, pixels);
}

TEST(GatherBatch, ScalesPixelsAndCopiesLabels) {
  Dataset ds;
  ds.count = 3;
  ds.features = 4;
  ds.num_classes = 10;
  ds.pixels = {0, 1, 2, 3, 255, 128, 51, 7, 10, 20, 30, 40};
  ds.labels = {7, 8, 9};
  const std::vector<uint32_t> indices = {2, 0, 2, 1};
  std::vector<float> x(indices.size() * ds.features, -1.0f);
  std::vector<uint8_t> labels(indices.size(), 99);
  GatherBatch(ds, indices, x.data(), labels.data());
  EXPECT_EQ(labels, (std::vector<uint8_t>{9, 7, 9, 8}));
  for (size_t i = 0; i < indices.size(); ++i) {
    for (size_t j = 0; j < ds.features; ++j) {
      EXPECT_EQ(x[i * 4 + j], static_cast<float>(ds.pixels[indices[i] * 4 + j]) / 255.0f)
          << i << "," << j;
    }
  }
  EXPECT_EQ(x[4 * 3 + 0], 1.0f);   // row 3 is sample 1: pixel 255
  EXPECT_EQ(x[4 * 3 + 2], 0.2f);   // 51/255 rounds to the float nearest 0.2
  EXPECT_EQ(x[4 * 1 + 0], 0.0f);
}

// ---------------------------------------------------------------------------------------------
// Sampler.

// The full permutation of an epoch, read through a world-size-1, batch-1 sampler.
std::vector<uint32_t> Perm(size_t n, uint64_t seed, int epoch) {
  Sampler s(n, 1, 0, 1, seed);
  std::vector<uint32_t> out;
  for (size_t t = 0; t < s.steps_per_epoch(); ++t) out.push_back(s.Batch(epoch, t)[0]);
  return out;
}

TEST(Sampler, StepsPerEpochIsFloor) {
  EXPECT_EQ(Sampler(103, 3, 0, 4, 1).steps_per_epoch(), 8u);   // G = 12
  EXPECT_EQ(Sampler(96, 3, 3, 4, 1).steps_per_epoch(), 8u);
  EXPECT_EQ(Sampler(95, 3, 0, 4, 1).steps_per_epoch(), 7u);
  EXPECT_EQ(Sampler(12, 3, 0, 4, 1).steps_per_epoch(), 1u);
  EXPECT_EQ(Sampler(11, 3, 0, 4, 1).steps_per_epoch(), 0u);
  EXPECT_EQ(Sampler(0, 1, 0, 1, 1).steps_per_epoch(), 0u);
  EXPECT_EQ(Sampler(60000, 64, 0, 1, 1).steps_per_epoch(), 937u);
  EXPECT_EQ(Sampler(60000, 16, 2, 4, 1).steps_per_epoch(), 937u);
}

TEST(Sampler, PermutationIsAPermutationAndMatchesTheDocumentedRecipe) {
  const std::vector<uint32_t> p = Perm(1000, 42, 0);
  ASSERT_EQ(p.size(), 1000u);
  std::vector<uint32_t> sorted = p;
  std::sort(sorted.begin(), sorted.end());
  for (uint32_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[i], i);
  // Shuffled: few fixed points (expected 1).
  int fixed = 0;
  for (uint32_t i = 0; i < 1000; ++i) fixed += p[i] == i;
  EXPECT_LT(fixed, 10);

  // Golden values from an independent Python transcription of the recipe in dataset.h
  // (SplitMix64; key = Rng(seed).Next(); stream = Rng(key ^ epoch).Next(); Fisher-Yates with
  // Below(i) for i = N..2). They pin the sample order across releases.
  EXPECT_EQ(Perm(10, 42, 0), (std::vector<uint32_t>{5, 1, 9, 6, 7, 2, 4, 0, 8, 3}));
  EXPECT_EQ(Perm(10, 42, 1), (std::vector<uint32_t>{8, 9, 1, 7, 6, 4, 3, 2, 0, 5}));
  EXPECT_EQ(Perm(10, 42, 2), (std::vector<uint32_t>{6, 1, 5, 7, 4, 8, 3, 2, 9, 0}));
  EXPECT_EQ(Perm(10, 7, 0), (std::vector<uint32_t>{4, 1, 9, 2, 5, 8, 0, 7, 3, 6}));
}

TEST(Sampler, RanksSliceEachGlobalBatchDisjointly) {
  const size_t n = 103, b = 3;
  const int world = 4;
  const size_t g = b * world;
  const uint64_t seed = 1234;
  for (int epoch : {0, 1, 5}) {
    SCOPED_TRACE("epoch " + std::to_string(epoch));
    const std::vector<uint32_t> perm = Perm(n, seed, epoch);
    std::vector<Sampler> ranks;
    for (int r = 0; r < world; ++r) ranks.emplace_back(n, b, r, world, seed);
    const size_t steps = ranks[0].steps_per_epoch();
    ASSERT_EQ(steps, 8u);
    std::vector<uint32_t> all;  // in (step, rank) order
    for (size_t t = 0; t < steps; ++t) {
      for (int r = 0; r < world; ++r) {
        std::span<const uint32_t> batch = ranks[r].Batch(epoch, t);
        ASSERT_EQ(batch.size(), b);
        all.insert(all.end(), batch.begin(), batch.end());
      }
    }
    // Together, in order, they are perm's first steps*G entries ...
    ASSERT_EQ(all.size(), steps * g);
    EXPECT_EQ(all, std::vector<uint32_t>(perm.begin(), perm.begin() + steps * g));
    // ... and no index appears twice (disjoint slices).
    EXPECT_EQ(std::set<uint32_t>(all.begin(), all.end()).size(), all.size());
  }
}

TEST(Sampler, OneWorkerWithBatch4bSeesWhatFourWorkersWithBatchBSee) {
  const size_t n = 250, b = 5;
  const uint64_t seed = 99;
  Sampler single(n, 4 * b, 0, 1, seed);
  std::vector<Sampler> ranks;
  for (int r = 0; r < 4; ++r) ranks.emplace_back(n, b, r, 4, seed);
  ASSERT_EQ(single.steps_per_epoch(), 12u);
  for (int r = 0; r < 4; ++r) ASSERT_EQ(ranks[r].steps_per_epoch(), 12u);
  for (int epoch = 0; epoch < 3; ++epoch) {
    for (size_t t = 0; t < single.steps_per_epoch(); ++t) {
      std::span<const uint32_t> whole = single.Batch(epoch, t);
      std::vector<uint32_t> concat;
      for (int r = 0; r < 4; ++r) {
        std::span<const uint32_t> part = ranks[r].Batch(epoch, t);
        concat.insert(concat.end(), part.begin(), part.end());
      }
      const std::vector<uint32_t> whole_v(whole.begin(), whole.end());
      EXPECT_EQ(whole_v, concat) << "epoch " << epoch << " step " << t;
      EXPECT_EQ(std::set<uint32_t>(whole_v.begin(), whole_v.end()),
                std::set<uint32_t>(concat.begin(), concat.end()));
    }
  }
}

TEST(Sampler, EpochsAndSeeds) {
  const size_t n = 500;
  const std::vector<uint32_t> e0 = Perm(n, 5, 0);
  const std::vector<uint32_t> e1 = Perm(n, 5, 1);
  const std::vector<uint32_t> e2 = Perm(n, 5, 2);
  EXPECT_NE(e0, e1);
  EXPECT_NE(e1, e2);
  EXPECT_NE(e0, e2);
  // Not a shift of each other (see the seeding note in dataset.cc).
  EXPECT_NE(std::vector<uint32_t>(e0.begin() + 1, e0.end()),
            std::vector<uint32_t>(e1.begin(), e1.end() - 1));
  // Same seed, same permutation; another seed, another one.
  EXPECT_EQ(Perm(n, 5, 1), e1);
  EXPECT_NE(Perm(n, 6, 0), e0);
  EXPECT_NE(Perm(n, 0, 0), Perm(n, 1, 0));
}

TEST(Sampler, CacheFollowsTheEpoch) {
  auto batch = [](Sampler& s, int epoch, size_t step) {
    const std::span<const uint32_t> b = s.Batch(epoch, step);
    return std::vector<uint32_t>(b.begin(), b.end());
  };
  Sampler s(64, 4, 1, 2, 77);
  const std::vector<uint32_t> first = batch(s, 0, 3);
  const std::vector<uint32_t> other = batch(s, 1, 3);
  const std::vector<uint32_t> again = batch(s, 0, 3);
  EXPECT_EQ(first, again);
  EXPECT_NE(first, other);
  Sampler fresh(64, 4, 1, 2, 77);
  EXPECT_EQ(batch(fresh, 1, 3), other);
}

}  // namespace
}  // namespace pipesgd::data

namespace pipesgd::data {
namespace {

// Regression: a 10x10 test set with a 28x28 training set used to be read out of bounds.
TEST(CheckSameShape, RejectsTestImagesOfAnotherShape) {
  Dataset train, test;
  train.rows = train.cols = 28;
  train.features = 784;
  test.rows = test.cols = 10;
  test.features = 100;
  try {
    CheckSameShape(train, "train.idx", test, "test.idx");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
    EXPECT_STREQ(e.what(), "test.idx has 10x10 images but train.idx has 28x28: a model trained "
                           "on one cannot be evaluated on the other");
  }
  // Same pixel count, other shape: still rejected.
  test.rows = 14;
  test.cols = 56;
  test.features = 784;
  EXPECT_THROW(CheckSameShape(train, "train.idx", test, "test.idx"), Error);
  test.rows = test.cols = 28;
  EXPECT_NO_THROW(CheckSameShape(train, "train.idx", test, "test.idx"));
}

}  // namespace
}  // namespace pipesgd::data
