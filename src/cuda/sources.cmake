# CUDA sources of the library (each a small translation unit: few template instantiations per file).
set(SONICMOE_CUDA_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/unimplemented.cpp
)
