# Cross build for 64-bit Arm Linux with Debian's cross toolchain and arm64 multiarch libraries
# (scripts/arm64_deps.sh installs them; scripts/arm64_check.sh uses this file):
#   cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake ...
# Test binaries run under qemu-user (CMAKE_CROSSCOMPILING_EMULATOR), so ctest and
# gtest_discover_tests work on an amd64 host. The arm64 loader and libraries come from the
# multiarch packages (/lib/ld-linux-aarch64.so.1, /usr/lib/aarch64-linux-gnu), found through the
# host's ld.so.cache; no sysroot is needed.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

# Libraries, headers and CMake packages: the arm64 multiarch ones (lib/aarch64-linux-gnu first,
# by CMAKE_LIBRARY_ARCHITECTURE); programs (protoc): the host's.
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
# pkg-config, which some find modules ask first (FindOpenSSL: its answer becomes a search hint
# ahead of the default paths), must read the arm64 .pc files, not the host's.
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")

find_program(PIPESGD_QEMU_AARCH64 NAMES qemu-aarch64 qemu-aarch64-static REQUIRED)
set(CMAKE_CROSSCOMPILING_EMULATOR ${PIPESGD_QEMU_AARCH64})
