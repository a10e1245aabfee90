// Opening a CUDA toolkit library at run time (dlopen) rather than linking it: cuBLAS and cuDNN
// are hundreds of MB, and merely loading them costs every pipesgd process (CPU jobs, tests, the
// launcher) time and memory. Only the functions the GPU layers call are resolved.
#pragma once

#include <mutex>
#include <optional>
#include <string>

#include "core/base/error.h"

namespace pipesgd::cuda {

struct Library {
  void* handle = nullptr;  // stays open for the life of the process
  std::string path;        // what was opened, for messages
};

// Opens `soname` (e.g. "libcudnn.so.9") from the loader's path, else from the lib directory of
// the toolkit this was built with. Throws Error(kUnavailable): "cannot load <what> (<soname>),
// needed for <needed_for>: <each loader error>; <hint>".
Library OpenCudaLibrary(const std::string& soname, const char* what, const char* needed_for,
                        const char* hint);

// The address of `name` in `lib`; Error(kUnavailable) naming both when it is missing (a
// different major version).
void* LibrarySymbol(const Library& lib, const char* name, const char* what);

template <typename F>
void Resolve(const Library& lib, const char* name, F& fn, const char* what) {
  fn = reinterpret_cast<F>(LibrarySymbol(lib, name, what));
}

// kLoad()'s result, computed by the first call that succeeds (a failure throws, and a later call
// tries again). Thread-safe.
template <typename Api, Api (*kLoad)()>
const Api& LoadedOnce() {
  static std::mutex mu;
  static std::optional<Api> api;
  std::lock_guard<std::mutex> lock(mu);
  if (!api) api = kLoad();
  return *api;
}

}  // namespace pipesgd::cuda
