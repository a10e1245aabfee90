#include "core/data/idx.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <utility>

#include "core/base/check.h"
#include "core/base/error.h"

namespace pipesgd::data {
namespace {

// Data larger than this is rejected before anything is allocated (Fashion-MNIST train is 47 MB).
constexpr uint64_t kMaxDataBytes = uint64_t{1} << 34;
constexpr uint8_t kUnsignedByte = 0x08;
constexpr size_t kGzipMinBytes = 18;  // 10-byte header + 8-byte trailer (CRC32, ISIZE)

// What the caller asked for.
struct Want {
  int ndims;             // 3 for images, 1 for labels
  const char* noun;      // "images" / "labels"
  const char* magic_hex; // "00 00 08 03" / "00 00 08 01"
};
constexpr Want kImages{3, "images", "00 00 08 03"};
constexpr Want kLabels{1, "labels", "00 00 08 01"};

struct IdxData {
  std::vector<uint32_t> dims;
  std::vector<uint8_t> data;
};

// The element types the IDX format defines (byte 2 of the magic).
const char* IdxTypeName(uint8_t type) {
  switch (type) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0B: return "int16";
    case 0x0C: return "int32";
    case 0x0D: return "float32";
    case 0x0E: return "float64";
    default: return nullptr;
  }
}

std::string HexBytes(const uint8_t* p, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) out += fmt::format("{}{:02x}", i ? " " : "", p[i]);
  return out;
}

// The bytes as text, non-printable ones as '.'.
std::string Printable(const uint8_t* p, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) out += (p[i] >= 0x20 && p[i] < 0x7f) ? char(p[i]) : '.';
  return out;
}

std::string U128ToString(unsigned __int128 v) {
  if (v == 0) return "0";
  std::string s;
  while (v > 0) {
    s.insert(s.begin(), char('0' + int(v % 10)));
    v /= 10;
  }
  return s;
}

uint32_t BigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

std::string DimsText(const std::vector<uint32_t>& dims) {
  std::string out;
  for (size_t i = 0; i < dims.size(); ++i) out += fmt::format("{}{}", i ? "x" : "", dims[i]);
  return out;
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Reads up to n bytes at offset; returns how many (fewer only at end of file).
size_t PreadFull(const std::string& path, int fd, uint8_t* dst, size_t n, off_t offset) {
  size_t done = 0;
  while (done < n) {
    const size_t chunk = std::min<size_t>(n - done, size_t{1} << 30);
    const ssize_t r = ::pread(fd, dst + done, chunk, offset + static_cast<off_t>(done));
    if (r < 0) {
      if (errno == EINTR) continue;
      Throw(ErrorCode::kIo, "{}: read failed at byte {}: {}", path, offset + done,
            std::strerror(errno));
    }
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  return done;
}

// Inflates a single-member gzip file read through `fd`, delivering exactly the bytes asked for
// (zlib's gzread reads ahead, so its errors would surface before the bytes they concern).
class GzipStream {
 public:
  GzipStream(const std::string& path, int fd, uint64_t file_size)
      : path_(path), fd_(fd), file_size_(file_size), in_(size_t{1} << 16) {
    if (inflateInit2(&zs_, 15 + 16) != Z_OK) {  // 15: max window; +16: gzip wrapper only
      Throw(ErrorCode::kInternal, "{}: inflateInit2 failed", path_);
    }
  }
  ~GzipStream() { inflateEnd(&zs_); }
  GzipStream(const GzipStream&) = delete;
  GzipStream& operator=(const GzipStream&) = delete;

  // Fills dst[0, n) with uncompressed bytes; returns how many (fewer only if the gzip stream
  // ended). Throws kDataLoss on corrupt or truncated input, naming the uncompressed bytes
  // produced so far and `expected_total` (0: not known yet, i.e. inside the IDX header).
  size_t Read(uint8_t* dst, size_t n, uint64_t expected_total) {
    size_t done = 0;
    while (done < n && !ended_) {
      if (zs_.avail_in == 0) Refill(expected_total);
      const size_t chunk = std::min<size_t>(n - done, size_t{1} << 30);
      zs_.next_out = dst + done;
      zs_.avail_out = static_cast<uInt>(chunk);
      const uInt avail_in_before = zs_.avail_in;
      const int rc = inflate(&zs_, Z_NO_FLUSH);
      const size_t produced = chunk - zs_.avail_out;
      done += produced;
      if (rc == Z_STREAM_END) {
        ended_ = true;
      } else if (rc == Z_BUF_ERROR && produced == 0 && zs_.avail_in == avail_in_before &&
                 zs_.avail_in != 0) {
        Throw(ErrorCode::kInternal, "{}: inflate made no progress", path_);
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
        Fail(fmt::format("zlib: {}", zs_.msg != nullptr ? zs_.msg : zError(rc)), expected_total);
      }
    }
    return done;
  }

  bool ended() const { return ended_; }
  uint64_t total_out() const { return zs_.total_out; }
  // Bytes of the file after the end of the gzip stream.
  uint64_t trailing_bytes() const { return file_size_ - (file_off_ - zs_.avail_in); }

 private:
  void Refill(uint64_t expected_total) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(in_.size(), file_size_ - file_off_));
    const size_t got =
        want == 0 ? 0 : PreadFull(path_, fd_, in_.data(), want, static_cast<off_t>(file_off_));
    if (got == 0) {
      Fail(fmt::format("the compressed data ends at byte {} of the file before the gzip stream "
                       "does",
                       file_off_),
           expected_total);
    }
    file_off_ += got;
    zs_.next_in = in_.data();
    zs_.avail_in = static_cast<uInt>(got);
  }

  [[noreturn]] void Fail(const std::string& why, uint64_t expected_total) {
    if (expected_total > 0) {
      Throw(ErrorCode::kDataLoss,
            "{}: gzip stream is corrupt or truncated: got {} of {} expected uncompressed bytes "
            "({})",
            path_, zs_.total_out, expected_total, why);
    }
    Throw(ErrorCode::kDataLoss,
          "{}: gzip stream is corrupt or truncated after {} uncompressed bytes, inside the IDX "
          "header ({})",
          path_, zs_.total_out, why);
  }

  const std::string& path_;
  int fd_;
  uint64_t file_size_;
  uint64_t file_off_ = 0;
  std::vector<uint8_t> in_;
  z_stream zs_{};
  bool ended_ = false;
};

// Checks the 4-byte magic in `head` (got = how many bytes the file/stream had, up to 4) against
// `want`; returns nothing, throws kDataLoss with the bytes seen and the magic expected.
void CheckMagic(const std::string& path, const uint8_t* head, size_t got, const Want& want,
                bool gzipped) {
  const char* where = gzipped ? "uncompressed content of the gzip file" : "file";
  if (got < 4) {
    Throw(ErrorCode::kDataLoss,
          "{}: not an IDX file: the {} is only {} bytes ({}), too short for the 4-byte magic; "
          "expected IDX magic {} for {}",
          path, where, got, got ? HexBytes(head, got) : "empty", want.magic_hex, want.noun);
  }
  const uint8_t type = head[2];
  const int ndims = head[3];
  if (head[0] != 0 || head[1] != 0 || IdxTypeName(type) == nullptr) {
    if (gzipped) {
      Throw(ErrorCode::kDataLoss,
            "{}: gzip content is not an IDX file: first uncompressed bytes {} ('{}'); expected "
            "IDX magic {} for {}",
            path, HexBytes(head, 4), Printable(head, 4), want.magic_hex, want.noun);
    }
    Throw(ErrorCode::kDataLoss,
          "{}: not an IDX file (neither gzip nor IDX magic): first bytes {} ('{}'); expected IDX "
          "magic {} for {}",
          path, HexBytes(head, 4), Printable(head, 4), want.magic_hex, want.noun);
  }
  const uint32_t magic = BigEndian32(head);
  if (type != kUnsignedByte) {
    Throw(ErrorCode::kDataLoss,
          "{}: unsupported IDX element type 0x{:02x} ({}) in magic 0x{:08x}; only 0x08 "
          "(unsigned byte) is supported (expected magic 0x000008{:02x} for {})",
          path, type, IdxTypeName(type), magic, want.ndims, want.noun);
  }
  if (ndims == want.ndims) return;
  if (ndims == 1 && want.ndims == 3) {
    Throw(ErrorCode::kDataLoss,
          "{}: is a labels file (1 dimension, magic 0x00000801) where an images file "
          "(3 dimensions, magic 0x00000803) was expected",
          path);
  }
  if (ndims == 3 && want.ndims == 1) {
    Throw(ErrorCode::kDataLoss,
          "{}: is an images file (3 dimensions, magic 0x00000803) where a labels file "
          "(1 dimension, magic 0x00000801) was expected",
          path);
  }
  Throw(ErrorCode::kDataLoss,
        "{}: IDX file has {} dimensions (magic 0x{:08x}) where {} {} file ({} dimension{}, magic "
        "0x000008{:02x}) was expected",
        path, ndims, magic, want.ndims == 3 ? "an" : "a", want.noun, want.ndims, want.ndims == 1 ? "" : "s", want.ndims);
}

// Parses the dims and returns the data size they declare; rejects zero image sizes and
// absurd totals.
uint64_t DataBytes(const std::string& path, const uint8_t* dim_bytes, const Want& want,
                   std::vector<uint32_t>* dims) {
  dims->resize(want.ndims);
  unsigned __int128 total = 1;
  for (int i = 0; i < want.ndims; ++i) {
    (*dims)[i] = BigEndian32(dim_bytes + 4 * i);
    total *= (*dims)[i];  // < 2^96: cannot overflow
  }
  for (int i = 1; i < want.ndims; ++i) {
    if ((*dims)[i] == 0) {
      Throw(ErrorCode::kDataLoss, "{}: IDX header declares {} {} with a zero dimension", path,
            DimsText(*dims), want.noun);
    }
  }
  if (total > kMaxDataBytes) {
    Throw(ErrorCode::kDataLoss,
          "{}: IDX header declares {} {} = {} data bytes, more than the limit of {} bytes (2^34); "
          "the header is corrupt",
          path, DimsText(*dims), want.noun, U128ToString(total), kMaxDataBytes);
  }
  return static_cast<uint64_t>(total);
}

IdxData ReadRaw(const std::string& path, int fd, uint64_t file_size, const Want& want) {
  std::array<uint8_t, 16> head{};
  const size_t got = PreadFull(path, fd, head.data(), head.size(), 0);
  CheckMagic(path, head.data(), got, want, /*gzipped=*/false);
  const size_t header_bytes = 4 + 4 * static_cast<size_t>(want.ndims);
  if (file_size < header_bytes) {
    Throw(ErrorCode::kDataLoss,
          "{}: truncated IDX header: the file has {} bytes, an IDX {} header needs {}", path,
          file_size, want.noun, header_bytes);
  }
  IdxData out;
  const uint64_t data_bytes = DataBytes(path, head.data() + 4, want, &out.dims);
  const uint64_t expected = header_bytes + data_bytes;
  if (file_size != expected) {
    Throw(ErrorCode::kDataLoss,
          "{}: file is {} bytes but its IDX header declares {} bytes ({}-byte header + {} {} = "
          "{} data bytes); the file is {} by {} bytes",
          path, file_size, expected, header_bytes, DimsText(out.dims), want.noun, data_bytes,
          file_size < expected ? "truncated" : "too long",
          file_size < expected ? expected - file_size : file_size - expected);
  }
  out.data.resize(data_bytes);
  const size_t read =
      PreadFull(path, fd, out.data.data(), data_bytes, static_cast<off_t>(header_bytes));
  if (read != data_bytes) {  // the file shrank under us
    Throw(ErrorCode::kDataLoss, "{}: file ended after {} of {} expected bytes", path,
          header_bytes + read, expected);
  }
  return out;
}

IdxData ReadGzip(const std::string& path, int fd, uint64_t file_size, const Want& want) {
  if (file_size < kGzipMinBytes) {
    Throw(ErrorCode::kDataLoss,
          "{}: truncated gzip file: {} bytes, fewer than the {} of an empty gzip file", path,
          file_size, kGzipMinBytes);
  }
  // ISIZE: the uncompressed size mod 2^32, little-endian, in the last 4 bytes. (For a file of
  // several gzip members it is the last member's size only; such files are rejected.)
  uint8_t trailer[4];
  if (PreadFull(path, fd, trailer, 4, static_cast<off_t>(file_size - 4)) != 4) {
    Throw(ErrorCode::kDataLoss, "{}: file shrank while reading its gzip trailer", path);
  }
  const uint32_t isize = uint32_t{trailer[0]} | (uint32_t{trailer[1]} << 8) |
                         (uint32_t{trailer[2]} << 16) | (uint32_t{trailer[3]} << 24);

  GzipStream gz(path, fd, file_size);
  std::array<uint8_t, 16> head{};
  const size_t got_magic = gz.Read(head.data(), 4, 0);
  CheckMagic(path, head.data(), got_magic, want, /*gzipped=*/true);
  const size_t header_bytes = 4 + 4 * static_cast<size_t>(want.ndims);
  const size_t got_dims = gz.Read(head.data() + 4, header_bytes - 4, 0);
  if (got_dims != header_bytes - 4) {
    Throw(ErrorCode::kDataLoss,
          "{}: truncated IDX header: the uncompressed content has {} bytes, an IDX {} header "
          "needs {}",
          path, 4 + got_dims, want.noun, header_bytes);
  }
  IdxData out;
  const uint64_t data_bytes = DataBytes(path, head.data() + 4, want, &out.dims);
  const uint64_t expected = header_bytes + data_bytes;
  const uint32_t expected_mod = static_cast<uint32_t>(expected);
  if (isize != expected_mod) {
    Throw(ErrorCode::kDataLoss,
          "{}: gzip trailer records {} uncompressed bytes (ISIZE, mod 2^32) but the IDX header "
          "declares {} bytes{} ({}-byte header + {} {} = {} data bytes); the file is truncated "
          "or corrupt",
          path, isize, expected,
          expected == expected_mod ? std::string() : fmt::format(" (mod 2^32: {})", expected_mod),
          header_bytes, DimsText(out.dims), want.noun, data_bytes);
  }
  out.data.resize(data_bytes);
  const size_t got = gz.Read(out.data.data(), data_bytes, expected);
  if (got != data_bytes) {
    Throw(ErrorCode::kDataLoss,
          "{}: gzip stream ended early: got {} of {} expected uncompressed bytes{}", path,
          header_bytes + got, expected,
          gz.trailing_bytes() > 0
              ? fmt::format(" and {} bytes follow it (multi-member gzip files are not supported)",
                            gz.trailing_bytes())
              : std::string());
  }
  // Exactly `expected` bytes, then the end of the stream (where zlib checks CRC32 and ISIZE),
  // then the end of the file.
  if (!gz.ended()) {
    uint8_t extra = 0;
    if (gz.Read(&extra, 1, expected) != 0) {
      Throw(ErrorCode::kDataLoss,
            "{}: gzip stream has more than the {} uncompressed bytes its IDX header declares",
            path, expected);
    }
  }
  if (gz.trailing_bytes() > 0) {
    Throw(ErrorCode::kDataLoss,
          "{}: {} bytes follow the end of the gzip stream (which held the {} uncompressed bytes "
          "the IDX header declares); multi-member gzip files and trailing data are not supported",
          path, gz.trailing_bytes(), expected);
  }
  return out;
}

IdxData ReadIdx(const std::string& path, const Want& want) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    Throw(err == ENOENT || err == ENOTDIR ? ErrorCode::kNotFound : ErrorCode::kIo,
          "{}: cannot open IDX {} file: {}", path, want.noun, std::strerror(err));
  }
  Fd guard(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    Throw(ErrorCode::kIo, "{}: fstat failed: {}", path, std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    Throw(ErrorCode::kDataLoss, "{}: not a regular file (expected an IDX {} file)", path,
          want.noun);
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  uint8_t magic[2] = {0, 0};
  const size_t got = PreadFull(path, fd, magic, 2, 0);
  if (got == 2 && magic[0] == 0x1f && magic[1] == 0x8b) {
    return ReadGzip(path, fd, file_size, want);
  }
  return ReadRaw(path, fd, file_size, want);
}

}  // namespace

IdxImages ReadIdxImages(const std::string& path) {
  IdxData raw = ReadIdx(path, kImages);
  PSGD_CHECK_EQ(raw.dims.size(), size_t{3});
  IdxImages out;
  out.count = raw.dims[0];
  out.rows = raw.dims[1];
  out.cols = raw.dims[2];
  out.pixels = std::move(raw.data);
  PSGD_CHECK_EQ(out.pixels.size(), out.count * out.rows * out.cols);
  return out;
}

std::vector<uint8_t> ReadIdxLabels(const std::string& path, int num_classes) {
  if (num_classes < 1) {
    Throw(ErrorCode::kInvalidArgument, "{}: num_classes must be >= 1, got {}", path,
          num_classes);
  }
  IdxData raw = ReadIdx(path, kLabels);
  PSGD_CHECK_EQ(raw.dims.size(), size_t{1});
  PSGD_CHECK_EQ(raw.data.size(), size_t{raw.dims[0]});
  for (size_t i = 0; i < raw.data.size(); ++i) {
    if (raw.data[i] >= num_classes) {
      Throw(ErrorCode::kDataLoss,
            "{}: label {} at index {} (of {}) is out of range: labels must be in [0, {}] for "
            "num_classes {}",
            path, raw.data[i], i, raw.data.size(), num_classes - 1, num_classes);
    }
  }
  return std::move(raw.data);
}

}  // namespace pipesgd::data
