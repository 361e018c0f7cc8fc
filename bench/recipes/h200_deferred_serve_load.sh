#!/usr/bin/env bash
# On the H200: the deferred GDN commit (`--deferred-rows P`) against the eager commit, end to end through the server.
# For each mode, one server per ring size (P = 0: eager; default P = 32, from bench/results/kernels/deferred_h200.md:
# the 32-row ring beat the 16-row one and the eager commit at B 1 / 8 / 32), up side by side (each with a fifth of the
# GPU memory) and driven by this checkout's serve_load, alternated twice, at concurrency 1 / 8 / 32 (the embedded
# model and drafter, greedy). The server's packages travel as wheels:
#   here:           bash bench/recipes/serve_wheels.sh download          (then carry .whl)
#   on the H200:    bash bench/recipes/h200_deferred_serve_load.sh       (MODES="ar chain tree-ready", ROWS="0 32";
#                   plain decoding at batch 32 / 64: MODES=ar SLOTS=64 CONC=32,64)
set -uo pipefail
source bench/recipes/serve_common.sh || exit 1


for mode in ${MODES:-ar chain tree-ready}; do
  declare -A PORT=()
  for rows in ${ROWS:-0 32}; do
    PORT[$rows]=$(start_server "$PWD" "$OUT/server_${mode}_p$rows.log" "${SERVE[@]}" --spec-mode "$mode" --deferred-rows "$rows") || exit 1
  done
  for rep in 1 2; do
    for rows in ${ROWS:-0 32}; do
      python3 -m hyspec_jax.bench.serve_load --url "http://127.0.0.1:${PORT[$rows]}" "${LOAD[@]}" \
        --json "$OUT/serve_load_${mode}_p${rows}_$rep.json" 2>&1 | tail -4
    done
  done
  for rows in ${ROWS:-0 32}; do kill -TERM "$(cat "$OUT/server_${mode}_p$rows.log.pid")"; done
  wait
  unset PORT
done
