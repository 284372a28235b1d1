# Sourced by the scripts: lets mpirun start ranks as root (containers, CI) and keeps each rank
# single-threaded, since ranks are the parallelism.
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=1
