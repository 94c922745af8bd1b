"""Kernels written against the public shmemx API (installed as ``shmemx.kernels``)."""
