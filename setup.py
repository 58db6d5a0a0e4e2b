"""The build steps pyproject.toml cannot say: two small C libraries, loaded through ctypes.

- nvImageCodec's allocators (``_alloc.c``): without it, Decoders use nvImageCodec's own allocation
  (``threadloader/decode/nvimgcodec/_allocators.py`` says what that costs).
- A group's file reads (``_reads.c``): without it, files are read by Python's calls, which let a
  training loop beside the readers take the GIL more often (``threadloader/_filereads.py``).

Both optional: where no C compiler is found the package installs without them.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "threadloader.decode.nvimgcodec._alloc",
            ["threadloader/decode/nvimgcodec/_alloc.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
            optional=True,
        ),
        Extension(
            "threadloader._reads",
            ["threadloader/_reads.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
            optional=True,
        ),
    ]
)
