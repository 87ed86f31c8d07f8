# Sourced by the scripts in this folder: set-up, then the environment that
# Open MPI needs on a developer machine or CI (root, fewer cores than ranks).
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
export PATH="${HPCNET_VENV:-$root/.venv}/bin:$PATH"
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# More ranks than cores is fine for functional runs on a laptop or CI box (the second: Open MPI 5's, whose
# runtime ignores the first; scripts/ftmpirun). By slot, as Open MPI 4 maps: by core, Open MPI 5 would put every
# rank on the first host of a --host list whose slots are given (the local cluster's).
export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=slot:oversubscribe
# Quiet Open MPI's warning about a missing high-speed network on one machine.
export OMPI_MCA_btl_base_warn_component_unused=0
cd "$root"
