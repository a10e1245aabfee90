#include "layers/cuda/cublas_loader.h"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include <fmt/format.h>

#include "core/base/error.h"

namespace pipesgd::cuda {
namespace {

template <typename F>
void Resolve(void* lib, const char* name, F& fn, const std::string& path) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (fn == nullptr) {
    Throw(ErrorCode::kUnavailable, "cuBLAS: {} has no symbol {} (a different cuBLAS major version?)",
          path, name);
  }
}

CublasApi Load() {
  const std::string name = fmt::format("libcublas.so.{}", CUBLAS_VER_MAJOR);
  std::string errors;
  void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string path = name;
  if (lib == nullptr) {
    errors = dlerror();
#ifdef PIPESGD_CUDA_LIBRARY_DIR
    // The toolkit this was built against (its lib dir is rarely on the loader's path).
    path = std::string(PIPESGD_CUDA_LIBRARY_DIR) + "/" + name;
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) errors += fmt::format("; {}", dlerror());
#endif
  }
  if (lib == nullptr) {
    Throw(ErrorCode::kUnavailable,
          "cannot load cuBLAS ({}), needed for model.device = CUDA: {}; install the CUDA "
          "toolkit's libcublas or add its directory to LD_LIBRARY_PATH",
          name, errors);
  }
  CublasApi api{};
  Resolve(lib, "cublasCreate_v2", api.create, path);
  Resolve(lib, "cublasDestroy_v2", api.destroy, path);
  Resolve(lib, "cublasSetStream_v2", api.set_stream, path);
  Resolve(lib, "cublasSetMathMode", api.set_math_mode, path);
  Resolve(lib, "cublasSgemm_v2", api.sgemm, path);
  Resolve(lib, "cublasSgemmStridedBatched", api.sgemm_strided_batched, path);
  Resolve(lib, "cublasGetStatusName", api.status_name, path);
  Resolve(lib, "cublasGetStatusString", api.status_string, path);
  return api;  // the library stays loaded for the life of the process
}

}  // namespace

const CublasApi& Cublas() {
  static std::mutex mu;
  static bool loaded = false;
  static CublasApi api;
  std::lock_guard<std::mutex> lock(mu);
  if (!loaded) {
    api = Load();  // throws; a later call tries again
    loaded = true;
  }
  return api;
}

}  // namespace pipesgd::cuda
