# The PyTorch backend (python/: `import pipesgd.torch`, the "pipesgd" torch.distributed backend
# and DDP hooks), built against Debian 12's PyTorch 1.13: libtorch-dev (headers, libtorch,
# libc10, libtorch_python), python3-torch and pybind11-dev. PIPESGD_TORCH=AUTO builds it when
# they are all found (not in the sanitizer, fuzz or minimal builds: the module is loaded by an
# uninstrumented python3, and it needs the job's config rules, built with the launcher).
set(PIPESGD_TORCH AUTO CACHE STRING "PyTorch backend (python/): AUTO, ON or OFF")
set_property(CACHE PIPESGD_TORCH PROPERTY STRINGS AUTO ON OFF)
if(NOT PIPESGD_TORCH MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "PIPESGD_TORCH=${PIPESGD_TORCH}: expected AUTO, ON or OFF")
endif()
set(PIPESGD_WITH_TORCH OFF)
# AUTO looks for PyTorch only in a native build with the launcher: a cross build (arm64) or the
# minimal one has no use for it, and pybind11's config stops the configure with a fatal error
# when it cannot run a python (seen in the arm64 cross build).
if(PIPESGD_TORCH STREQUAL "ON" OR
   (PIPESGD_TORCH STREQUAL "AUTO" AND NOT PIPESGD_SANITIZE AND NOT PIPESGD_FUZZ AND
    NOT CMAKE_CROSSCOMPILING AND PIPESGD_BUILD_LAUNCHER))
  set(_torch_missing "")
  if(NOT PIPESGD_BUILD_LAUNCHER)
    list(APPEND _torch_missing "PIPESGD_BUILD_LAUNCHER=ON (the backend uses the job's comm settings)")
  endif()
  # Debian's python3, which python3-torch is installed for (not another python3 on PATH).
  if(NOT DEFINED Python3_EXECUTABLE AND EXISTS /usr/bin/python3)
    set(Python3_EXECUTABLE /usr/bin/python3)
  endif()
  find_package(Python3 COMPONENTS Interpreter Development.Module QUIET)
  if(Python3_FOUND)
    # pybind11's own search for a python: the one found above, not another on PATH.
    set(PYTHON_EXECUTABLE ${Python3_EXECUTABLE})
    find_package(pybind11 CONFIG QUIET)
  endif()
  find_path(PIPESGD_TORCH_INCLUDE torch/csrc/distributed/c10d/ProcessGroup.hpp)
  foreach(lib torch torch_cpu c10 torch_python)
    find_library(PIPESGD_TORCH_LIB_${lib} ${lib})
    if(NOT PIPESGD_TORCH_LIB_${lib})
      list(APPEND _torch_missing "lib${lib} (libtorch-dev)")
    endif()
  endforeach()
  if(Python3_FOUND)
    execute_process(COMMAND ${Python3_EXECUTABLE} -c "import torch"
                    RESULT_VARIABLE _torch_import OUTPUT_QUIET ERROR_QUIET)
    if(NOT _torch_import EQUAL 0)
      list(APPEND _torch_missing "PyTorch for ${Python3_EXECUTABLE} (python3-torch)")
    endif()
  else()
    list(APPEND _torch_missing "python3 and its headers (python3-dev)")
  endif()
  if(NOT pybind11_FOUND)
    list(APPEND _torch_missing "pybind11 (pybind11-dev)")
  endif()
  if(NOT PIPESGD_TORCH_INCLUDE)
    list(APPEND _torch_missing "torch's c10d headers (libtorch-dev)")
  endif()
  if(_torch_missing STREQUAL "")
    set(PIPESGD_WITH_TORCH ON)
    message(STATUS "PyTorch backend: built (python/pipesgd; PYTHONPATH=${CMAKE_BINARY_DIR}/python)")
  elseif(PIPESGD_TORCH STREQUAL "ON")
    list(JOIN _torch_missing ", " _why)
    message(FATAL_ERROR "PIPESGD_TORCH=ON: missing ${_why} (scripts/install_deps.sh installs them)")
  else()
    list(JOIN _torch_missing ", " _why)
    message(STATUS "PyTorch backend: not built (missing ${_why})")
  endif()
else()
  message(STATUS "PyTorch backend: not built (PIPESGD_TORCH=${PIPESGD_TORCH}; a sanitizer, fuzz, "
                 "cross or minimal build)")
endif()
