# Sourced by the scripts: lets mpirun start ranks as root (containers, CI) and keeps each rank
# single-threaded, since ranks are the parallelism.
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
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
