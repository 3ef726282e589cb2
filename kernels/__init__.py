"""Block formats, the numpy reference kernels, and (with CuPy) the CUDA kernels.

Importing any part of the package fills the kernel registry: the CPU references, then the CUDA kernels
(whose definitions need no CuPy), each registering itself where it is defined.
"""

from kernels import cpu as _cpu  # noqa: F401  (registers the CPU kernels first)
from kernels.cuda import kernels as _cuda_kernels  # noqa: F401
