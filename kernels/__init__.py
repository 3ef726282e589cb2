"""Block formats, the numpy reference kernels, and (with CuPy) the CUDA kernels."""
