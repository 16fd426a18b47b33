# Locates the CUTLASS/CuTe headers shipped in the PyPI wheel nvidia-cutlass, at the version pinned in
# third_party/CUTLASS_VERSION (the only place the version is written).
#   SONICMOE_CUTLASS_INCLUDE  set it to a folder holding cute/ and cutlass/ to skip the lookup
#                             (the device runs carry the headers this way).
file(STRINGS "${PROJECT_SOURCE_DIR}/third_party/CUTLASS_VERSION" SONICMOE_CUTLASS_VERSION LIMIT_COUNT 1)

if(NOT SONICMOE_CUTLASS_INCLUDE)
  find_package(Python3 COMPONENTS Interpreter REQUIRED)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c
      "import importlib.metadata as m, os, cutlass_library as c; print(m.version('nvidia-cutlass')); print(os.path.join(os.path.dirname(c.__file__), 'source', 'include'))"
    OUTPUT_VARIABLE _out RESULT_VARIABLE _rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR
      "CUTLASS headers not found: install them with\n"
      "  ${Python3_EXECUTABLE} -m pip install --no-deps nvidia-cutlass==${SONICMOE_CUTLASS_VERSION}\n"
      "or pass -DSONICMOE_CUTLASS_INCLUDE=<folder with cute/ and cutlass/>.")
  endif()
  string(REPLACE "\n" ";" _out "${_out}")
  list(GET _out 0 _found_version)
  list(GET _out 1 _include)
  if(NOT _found_version STREQUAL SONICMOE_CUTLASS_VERSION)
    message(FATAL_ERROR "nvidia-cutlass ${_found_version} is installed, sonicmoe pins ${SONICMOE_CUTLASS_VERSION}: "
                        "pip install --no-deps nvidia-cutlass==${SONICMOE_CUTLASS_VERSION}")
  endif()
  set(SONICMOE_CUTLASS_INCLUDE "${_include}" CACHE PATH "CUTLASS/CuTe include folder" FORCE)
endif()

if(NOT EXISTS "${SONICMOE_CUTLASS_INCLUDE}/cute/tensor.hpp")
  message(FATAL_ERROR "SONICMOE_CUTLASS_INCLUDE=${SONICMOE_CUTLASS_INCLUDE} holds no cute/tensor.hpp")
endif()
message(STATUS "sonicmoe: CUTLASS ${SONICMOE_CUTLASS_VERSION} headers at ${SONICMOE_CUTLASS_INCLUDE}")
