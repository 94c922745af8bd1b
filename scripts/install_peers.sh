#!/usr/bin/env bash
# Install the peers that scripts/bench_rma.py and scripts/bench_sync.py measure beside shmemx, on Debian:
#   shmem4py over Open MPI's OSHMEM (oshrun), and mpi4py over MPICH (mpiexec.mpich).
# Usage: bash scripts/install_peers.sh [PYTHON]   (default: the python3 on PATH, e.g. the project's venv)
# Needs root (apt-get). Takes 1.5-3 minutes (most of it compiling shmem4py's cffi module).
#
# Workarounds this machine needs (../shared/reference/peers.md), applied by the benchmarks when they run a peer:
#   OMPI_MCA_osc=^rdma (Open MPI 4.1.4 crashes in shmem_finalize without it), OMPI_ALLOW_RUN_AS_ROOT[_CONFIRM]=1,
#   --oversubscribe beyond 2 PEs, SHMEM_SYMMETRIC_HEAP_SIZE for buffers past ~256 MiB.
# Installing openmpi-bin switches the mpirun/mpiexec alternatives to Open MPI: the benchmarks call
# oshrun and mpiexec.mpich by name. mpi4py's binary wheel looks for libmpi.so.12, which Debian's MPICH names
# libmpich.so.12: a link in <venv>/lib/shmemx-peers provides it (the benchmarks put that folder on
# LD_LIBRARY_PATH for the MPI jobs).
set -euo pipefail
PY=${1:-python3}
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends openmpi-bin libopenmpi-dev mpich libmpich-dev gcc
OSHCC=oshcc "$PY" -m pip install -q shmem4py
"$PY" -m pip install -q mpi4py
prefix=$("$PY" -c 'import sys; print(sys.prefix)')
mkdir -p "$prefix/lib/shmemx-peers"
lib=$(ls /usr/lib/*/libmpich.so.12 | head -1)
ln -sf "$lib" "$prefix/lib/shmemx-peers/libmpi.so.12"
echo "peers installed: shmem4py $("$PY" -c 'import shmem4py; print(shmem4py.__version__)'), mpi4py $("$PY" -c 'import mpi4py; print(mpi4py.__version__)')"
