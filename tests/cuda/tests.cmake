# CUDA test suites; each links the library (CPU reference included) and compares against it.
# Add one sonicmoe_add_test(...) per suite.
