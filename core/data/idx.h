// Reader for the IDX format of MNIST and Fashion-MNIST (http://yann.lecun.com/exdb/mnist/),
// raw or gzipped.
//
// IDX layout (all integers big-endian):
//   magic: u32; bytes 0-1 are zero, byte 2 is the element type (0x08 = unsigned byte),
//          byte 3 the number of dimensions
//   dims:  ndims x u32
//   data:  prod(dims) elements of the element type
// Images are 0x00000803 (count, rows, cols); labels 0x00000801 (count).
//
// Every check happens before the data is allocated: the magic, the header, and that the sizes the
// header declares match the file (for gzip, the uncompressed size recorded in the gzip trailer).
// Each failure throws pipesgd::Error(kDataLoss, or kNotFound for a missing file) naming the file
// and the expected and actual values.
//
// A file starting with 1f 8b is gzip, anything else is read as raw IDX. For gzip, the ISIZE
// field of the trailer (uncompressed size mod 2^32) is compared with the header before
// allocating, and the stream must then yield exactly that many bytes, end, and pass its CRC32.
// Only single-member gzip files are supported (ISIZE covers the last member only); bytes after
// the gzip stream are rejected. Headers
// declaring more than 2^34 data bytes, or an image with 0 rows or columns, are rejected. Other
// open/read failures (permissions, I/O) throw kIo.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pipesgd::data {

struct IdxImages {
  size_t count = 0;
  size_t rows = 0;
  size_t cols = 0;
  std::vector<uint8_t> pixels;  // (count, rows, cols) row-major
};

// Reads an images file (magic 0x00000803).
IdxImages ReadIdxImages(const std::string& path);

// Reads a labels file (magic 0x00000801); every label must be < num_classes (kDataLoss naming
// the index and value of the first one that is not). num_classes < 1: kInvalidArgument.
std::vector<uint8_t> ReadIdxLabels(const std::string& path, int num_classes);

}  // namespace pipesgd::data
