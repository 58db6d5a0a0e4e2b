"""The one build step pyproject.toml cannot say: nvImageCodec's allocators in C (``_alloc.c``).

Optional: where no C compiler is found the package installs without it, and its Decoders use
nvImageCodec's own allocation (``threadloader/decode/nvimgcodec/_allocators.py`` says what that costs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "threadloader.decode.nvimgcodec._alloc",
            ["threadloader/decode/nvimgcodec/_alloc.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
            optional=True,
        )
    ]
)
