#!/usr/bin/env bash
# Install the peers that scripts/bench_rma.py and scripts/bench_sync.py measure beside shmemx, on Debian:
#   shmem4py over Open MPI's OSHMEM (oshrun), and mpi4py over MPICH (mpiexec.mpich).
# Usage: bash scripts/install_peers.sh [PYTHON]   (default: the python3 on PATH, e.g. the project's venv)
# Needs root (apt-get). Takes 1.5-3 minutes (most of it compiling shmem4py's cffi module).
#
# Workarounds this machine needs (../shared/reference/peers.md), applied by the benchmarks when they run a peer:
#   OMPI_MCA_osc=^rdma (Open MPI 4.1.4 crashes in shmem_finalize without it), OMPI_ALLOW_RUN_AS_ROOT[_CONFIRM]=1,
#   --oversubscribe beyond 2 PEs, SHMEM_SYMMETRIC_HEAP_SIZE for buffers past ~256 MiB.
# Installing openmpi-bin switches the mpicc/mpirun/mpiexec alternatives to Open MPI: the benchmarks call oshrun
# and mpiexec.mpich by name, and mpi4py is compiled here against MPICH (MPICC=mpicc.mpich, from source).
set -euo pipefail
PY=${1:-python3}
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends openmpi-bin libopenmpi-dev mpich libmpich-dev gcc
OSHCC=oshcc "$PY" -m pip install -q shmem4py
MPICC=mpicc.mpich "$PY" -m pip install -q --no-binary mpi4py --no-cache-dir --force-reinstall --no-deps mpi4py
echo "peers installed: shmem4py $("$PY" -c 'import shmem4py; print(shmem4py.__version__)'), mpi4py $("$PY" -c 'import mpi4py; print(mpi4py.__version__)')"
