# `cmake --install build --prefix P` installs:
#   P/include/pipesgd/{pipesgd,error,types}.h   the embedding API (docs/library.md), and nothing
#                                               else: the library's own headers are not installed
#   P/lib/libpipesgd_*.a                        static libraries, one per folder (not the CUDA
#                                               backend's pipesgd_layers_cuda/pipesgd_core_cuda:
#                                               no exported target links them)
#   P/lib/cmake/pipesgd/                        find_package(pipesgd): pipesgd::pipesgd (the
#       other exported targets, ::base, ::transport, ... are its link dependencies, not APIs)
#   P/lib/pkgconfig/pipesgd.pc                  pkg-config --cflags --libs pipesgd
#   P/bin/pipesgd                               the launcher (PIPESGD_BUILD_LAUNCHER)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(_psgd_targets pipesgd_base pipesgd_transport pipesgd_collective pipesgd_train pipesgd_data
    pipesgd_core pipesgd_api)
if(PIPESGD_BUILD_LAYERS)
  list(APPEND _psgd_targets pipesgd_layers)
endif()
foreach(t IN LISTS _psgd_targets)
  string(REPLACE "pipesgd_" "" _name ${t})
  set_target_properties(${t} PROPERTIES EXPORT_NAME ${_name})
endforeach()
set_target_properties(pipesgd_api PROPERTIES EXPORT_NAME pipesgd)

install(TARGETS ${_psgd_targets} EXPORT pipesgdTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/pipesgd ${CMAKE_INSTALL_INCLUDEDIR})
if(PIPESGD_BUILD_LAUNCHER)
  install(TARGETS pipesgd RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

# The public interface only: include/pipesgd/*.h (pipesgd.h and the two it includes). The
# library's own headers stay in the source tree, so an embedder depends on nothing internal.
install(DIRECTORY ${PIPESGD_ROOT}/include/pipesgd/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/pipesgd
        FILES_MATCHING PATTERN "*.h")

# What the static libraries need from the consumer's link line, for the package config and .pc.
get_target_property(_psgd_tdefs pipesgd_transport INTERFACE_COMPILE_DEFINITIONS)
set(PIPESGD_HAVE_UCX OFF)
set(PIPESGD_HAVE_IBVERBS OFF)
set(PIPESGD_HAVE_ONEDNN OFF)
set(_pc_extra "")
if("PIPESGD_HAVE_UCX=1" IN_LIST _psgd_tdefs)
  set(PIPESGD_HAVE_UCX ON)
  string(APPEND _pc_extra " -lucp -luct -lucs")
endif()
if("PIPESGD_HAVE_IBVERBS=1" IN_LIST _psgd_tdefs)
  set(PIPESGD_HAVE_IBVERBS ON)
  string(APPEND _pc_extra " -libverbs")
  foreach(l IN LISTS CMAKE_DL_LIBS)
    string(APPEND _pc_extra " -l${l}")
  endforeach()
endif()
set(_pc_libs "-lpipesgd_api -lpipesgd_core -lpipesgd_train -lpipesgd_data -lpipesgd_collective")
if(PIPESGD_BUILD_LAYERS)
  string(APPEND _pc_libs " -lpipesgd_layers")
  foreach(l IN LISTS BLAS_LIBRARIES)
    string(APPEND _pc_extra " ${l}")
  endforeach()
  if(TARGET DNNL::dnnl)
    set(PIPESGD_HAVE_ONEDNN ON)
    string(APPEND _pc_extra " -ldnnl")
  endif()
endif()
string(APPEND _pc_libs " -lpipesgd_transport -lpipesgd_base")
set(PIPESGD_PC_LIBS "${_pc_libs}${_pc_extra}")
# Relocatable .pc: the prefix is found from the file's own directory (lib/pkgconfig -> ../..).
string(REGEX REPLACE "[^/]+" ".." PIPESGD_PC_UP "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
configure_file(${PIPESGD_ROOT}/cmake/pipesgd.pc.in ${CMAKE_BINARY_DIR}/pipesgd.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/pipesgd.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

install(EXPORT pipesgdTargets NAMESPACE pipesgd::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/pipesgd)
configure_package_config_file(${PIPESGD_ROOT}/cmake/pipesgdConfig.cmake.in
  ${CMAKE_BINARY_DIR}/pipesgdConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/pipesgd)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/pipesgdConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/pipesgdConfig.cmake ${CMAKE_BINARY_DIR}/pipesgdConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/pipesgd)
