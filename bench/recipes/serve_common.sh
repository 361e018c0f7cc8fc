# Sourced by the side-by-side server recipes (h200_serve_load.sh, h200_deferred_serve_load.sh), from the repository
# root: the server's wheels installed, the recipes' set-up, each server with a fifth of the GPU memory, and the
# server and load options both compare under (SLOTS: the servers' slots, 32; CONC: the concurrencies, 1,8,32).
source bench/recipes/serve_wheels.sh install .whl || exit 1
source bench/recipes/lib.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.2
SERVE=(--port 0 --max-batch "${SLOTS:-32}" --max-queue 256 --max-model-len 1024 --prefill-chunk 128)
LOAD=(--concurrency "${CONC:-1,8,32}" --num-requests 64 --max-tokens 64)
