# Sourced by the scripts: lets mpirun start ranks as root (containers, CI) and keeps each rank
# single-threaded, since ranks are the parallelism.
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
# OpenMPI will not start, even ranks on this machine only (or one program without mpirun), when
# neither ssh nor rsh is installed; `false` in their place is never run for local ranks.
# Open MPI 5's launcher (PRRTE) reads the same setting under its own name.
if ! command -v ssh >/dev/null && ! command -v rsh >/dev/null; then
  export OMPI_MCA_plm_rsh_agent="${OMPI_MCA_plm_rsh_agent-$(type -P false)}"
  export PRTE_MCA_plm_ssh_agent="${PRTE_MCA_plm_ssh_agent-$(type -P false)}"
fi
# Jobs for builds and ctest: every core this process may use. Read before OMP_NUM_THREADS is
# set below, because GNU nproc honours that variable.
export TESSERA_JOBS="${TESSERA_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"
export OMP_NUM_THREADS=1

# Configures build directory $1 with the remaining arguments: Ninja when it is installed (it
# compiles a target's sources while the libraries they link are still building, which make
# does not), unless the directory was already configured with another generator.
tessera_configure() {
  local dir="$1"
  shift
  local generator=()
  if [ ! -f "$dir/CMakeCache.txt" ] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
  cmake -S "$(dirname "${BASH_SOURCE[0]}")/.." -B "$dir" "${generator[@]}" "$@" >/dev/null
}
