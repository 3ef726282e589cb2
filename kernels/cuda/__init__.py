"""CUDA kernels compiled at run time with CuPy's RawModule (NVRTC), their launchers and backend."""
