#include "layers/cuda/library.h"

#include <dlfcn.h>

#include <fmt/format.h>

namespace pipesgd::cuda {

Library OpenCudaLibrary(const std::string& soname, const char* what, const char* needed_for,
                        const char* hint) {
  Library lib{dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL), soname};
  std::string errors;
  if (lib.handle == nullptr) {
    errors = dlerror();
#ifdef PIPESGD_CUDA_LIBRARY_DIR
    // The toolkit this was built against (its lib dir is rarely on the loader's path).
    lib.path = std::string(PIPESGD_CUDA_LIBRARY_DIR) + "/" + soname;
    lib.handle = dlopen(lib.path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib.handle == nullptr) errors += fmt::format("; {}", dlerror());
#endif
  }
  if (lib.handle == nullptr) {
    Throw(ErrorCode::kUnavailable, "cannot load {} ({}), needed for {}: {}; {}", what, soname,
          needed_for, errors, hint);
  }
  return lib;
}

void* LibrarySymbol(const Library& lib, const char* name, const char* what) {
  void* fn = dlsym(lib.handle, name);
  if (fn == nullptr) {
    Throw(ErrorCode::kUnavailable, "{}: {} has no symbol {} (a different {} major version?)", what,
          lib.path, name, what);
  }
  return fn;
}

}  // namespace pipesgd::cuda
