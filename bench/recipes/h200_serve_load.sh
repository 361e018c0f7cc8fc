#!/usr/bin/env bash
# On the H200: `serve_load` against this checkout's server and — if BASE names another checkout's root (its
# checkpoints/ linked to these) — against that one, up side by side (each with a fifth of the GPU memory) and driven
# by the same client (this checkout's serve_load, httpx), alternated twice, at concurrency 1 / 8 / 32, for ar and
# tree-ready (the embedded model and drafter). The server's packages travel as wheels:
#   here:           bash bench/recipes/serve_wheels.sh download          (then carry .whl)
#   on the H200:    BASE=_base bash bench/recipes/h200_serve_load.sh     (MODES=ar: plain decoding only; REPS=3: three
#                   alternations instead of two)
set -uo pipefail
source bench/recipes/serve_common.sh || exit 1


for mode in ${MODES:-ar tree-ready}; do
  roots=(new); PORT_new=$(start_server "$PWD" "$OUT/server_new_$mode.log" "${SERVE[@]}" --spec-mode "$mode") || exit 1
  if [ -n "${BASE:-}" ]; then roots+=(base); PORT_base=$(start_server "$BASE" "$OUT/server_base_$mode.log" "${SERVE[@]}" --spec-mode "$mode") || exit 1; fi
  for rep in $(seq "${REPS:-2}"); do
    for r in "${roots[@]}"; do
      port_var=PORT_$r
      python3 -m hyspec_jax.bench.serve_load --url "http://127.0.0.1:${!port_var}" "${LOAD[@]}" \
        --json "$OUT/serve_load_${r}_${mode}_$rep.json" 2>&1 | tail -4
    done
  done
  for r in "${roots[@]}"; do kill -TERM "$(cat "$OUT/server_${r}_$mode.log.pid")"; done
  wait
done
