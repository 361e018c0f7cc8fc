#!/usr/bin/env bash
# [startup] on one GPU: where a server's start-up compile goes (`hyspec bench serve-compile`: each program's trace,
# lower, XLA's passes, autotuning, code generation, cold and from the persistent cache) at the embedded model's
# geometry in the tree mode, over STARTUP_SLOTS slots (default 4: decoding buckets 1 and 4, so that the run fits
# beside other steps in one device call; the default server has 32) and a 2048-token context (the server's default).
# Usage (repository root, device machine): bash bench/recipes/startup_gpu.sh
source bench/recipes/lib.sh
timeout ${STARTUP_TIMEOUT:-300} "${H[@]}" bench serve-compile --config checkpoints/default --spec-mode tree \
  --max-batch ${STARTUP_SLOTS:-4} --max-model-len 2048 --compile-workers 1 --no-progress \
  --json "$OUT/serve_compile_gpu.json" 2>&1 | tail -40
