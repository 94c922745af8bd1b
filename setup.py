"""The native parts of shmemx (the DMA engine, the waits), built with the system C compiler by ``pip install``.

Everything else is in pyproject.toml. A machine without a C compiler and the Python headers cannot install
shmemx: the engine has one execution path, the native one (see the README, Performance).
"""

from setuptools import Extension, setup

_FLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function"]

setup(
    ext_modules=[
        Extension("shmemx.udma._engine", ["shmemx/udma/_engine.c", "shmemx/udma/_post.c", "shmemx/udma/_chaos.c",
                                                "shmemx/udma/_events.c"],
                  depends=["shmemx/shm/wake.h", "shmemx/udma/_engine.h", "shmemx/udma/_config.h"],
                  extra_compile_args=_FLAGS, libraries=["pthread", "m"]),
        Extension("shmemx.shm._native", ["shmemx/shm/_native.c"], depends=["shmemx/shm/wake.h"],
                  extra_compile_args=_FLAGS),
        # the combine's bfloat16 reduce (kernels/moe/combine.py); -O3 lets gcc vectorise its loops across columns
        # (no -ffast-math: the float32 adds stay exactly those of the reference, in order)
        Extension("shmemx.kernels.moe._reduce", ["kernels/moe/_reduce.c"], extra_compile_args=_FLAGS + ["-O3"]),
    ],
)
