# NCCL for the expert-parallel layer's NCCL communicator (src/moe/ep_nccl.cpp, include/sonicmoe/ep.h), optional.
# SONICMOE_NCCL: AUTO (use NCCL when found), ON (fail without it), OFF. Only with the CUDA backend. Searched in
# SONICMOE_NCCL_ROOT, then the nvidia-nccl-cu13 / -cu12 pip wheel of the Python found (site-packages/nvidia/nccl:
# include/nccl.h, lib/libnccl.so.2), then the system paths. Without it the library builds and
# make_nccl_communicator throws an Error saying so. Sets SONICMOE_WITH_NCCL; call after the sonicmoe target exists.
set(SONICMOE_NCCL AUTO CACHE STRING "NCCL communicator for expert parallelism: AUTO, ON or OFF")
set_property(CACHE SONICMOE_NCCL PROPERTY STRINGS AUTO ON OFF)
set(SONICMOE_NCCL_ROOT "" CACHE PATH "NCCL folder holding include/nccl.h and lib/libnccl.so*; empty: the pip wheel or system")
set(SONICMOE_WITH_NCCL OFF)

if(NOT SONICMOE_NCCL STREQUAL "OFF" AND SONICMOE_WITH_CUDA)
  set(_sonicmoe_nccl_hints ${SONICMOE_NCCL_ROOT})
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    # nvidia.nccl is a namespace package (no __file__): its folder is __path__[0].
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c "import nvidia.nccl as n; print(list(n.__path__)[0])"
      OUTPUT_VARIABLE _sonicmoe_nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
      RESULT_VARIABLE _sonicmoe_nccl_rc)
    if(_sonicmoe_nccl_rc EQUAL 0 AND _sonicmoe_nccl_wheel)
      list(APPEND _sonicmoe_nccl_hints ${_sonicmoe_nccl_wheel})
    endif()
  endif()
  find_path(SONICMOE_NCCL_INCLUDE nccl.h HINTS ${_sonicmoe_nccl_hints} PATH_SUFFIXES include)
  # the wheel ships only libnccl.so.2 (no libnccl.so link)
  find_library(SONICMOE_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_sonicmoe_nccl_hints} PATH_SUFFIXES lib lib64)
  if(SONICMOE_NCCL_INCLUDE AND SONICMOE_NCCL_LIBRARY)
    set(SONICMOE_WITH_NCCL ON)
    message(STATUS "sonicmoe: NCCL communicator with ${SONICMOE_NCCL_LIBRARY} (headers ${SONICMOE_NCCL_INCLUDE})")
  elseif(SONICMOE_NCCL STREQUAL "ON")
    message(FATAL_ERROR "sonicmoe: SONICMOE_NCCL=ON but nccl.h / libnccl.so were not found (pip install "
                        "nvidia-nccl-cu13, or set SONICMOE_NCCL_ROOT)")
  else()
    message(STATUS "sonicmoe: NCCL not found, building without the NCCL communicator")
  endif()
elseif(SONICMOE_NCCL STREQUAL "ON" AND NOT SONICMOE_WITH_CUDA)
  message(FATAL_ERROR "sonicmoe: SONICMOE_NCCL=ON needs the CUDA backend (nvcc not found or SONICMOE_CUDA=OFF)")
endif()

# the tests (a sibling folder) read SONICMOE_WITH_NCCL too
set(SONICMOE_WITH_NCCL ${SONICMOE_WITH_NCCL} PARENT_SCOPE)
if(SONICMOE_WITH_NCCL)
  target_compile_definitions(sonicmoe PRIVATE SONICMOE_WITH_NCCL=1)
  target_include_directories(sonicmoe SYSTEM PRIVATE ${SONICMOE_NCCL_INCLUDE})
  target_link_libraries(sonicmoe PUBLIC ${SONICMOE_NCCL_LIBRARY})
endif()
