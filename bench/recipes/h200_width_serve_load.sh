#!/usr/bin/env bash
# On the H200: the verify width chosen each round (hyspec_jax/spec/width.py) end to end through the server.
# 1. `hyspec calibrate` times the engine's own round at every width bucket (1 = plain decoding .. 32) for the
#    server's bucket (SLOTS slots; KV ≥ max-model-len + the round's overshoot) into the embedded model's table,
#    which the server reads by default (a copy comes back as $OUT/budget_table.json);
# 2. `serve_load` (greedy, 64 tokens a request) of tree-ready — the width then chosen each round — against plain
#    decoding (ar), at concurrency 1 / 4 / 8 / 16 / 32 / 64, on random-word and held-out prompts, each twice.
# --spec-mode is given: without it the embedded drafter's recommended_modes.json (max_slots 8) decodes plainly
# with more than 8 slots. The server's packages travel as wheels:
#   here:           bash bench/recipes/serve_wheels.sh download          (then carry .whl)
#   on the H200:    bash bench/recipes/h200_width_serve_load.sh
# Knobs: SLOTS (64), MODES ("ar tree-ready"), DATASETS ("random heldout"), REPS (2), REQUESTS (128 a level).
# Everything (calibration, table, server logs, serve_load JSON) lands in one archive, $OUT/width_serve_load.tgz.
set -uo pipefail
source bench/recipes/serve_wheels.sh install .whl || exit 1
source bench/recipes/lib.sh
SLOTS=${SLOTS:-64}; LEN=1024; RES=$(mktemp -d)
"${H[@]}" calibrate --spec-mode tree-ready --batch "$SLOTS" --kv-len $((LEN + 16)) --nodes 1,32 --repeats 20 \
  --out checkpoints/default/budget_table.json --json > "$RES/calibrate.json" || exit 1
cp checkpoints/default/budget_table.json "$RES/budget_table.json"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.4
SERVE=(--port 0 --max-batch "$SLOTS" --max-queue 256 --max-model-len $LEN --prefill-chunk 128)
LOAD=(--concurrency 1,4,8,16,32,64 --num-requests "${REQUESTS:-128}" --max-tokens 64)

for mode in ${MODES:-ar tree-ready}; do
  PORT=$(start_server "$PWD" "$RES/server_$mode.log" "${SERVE[@]}" --spec-mode "$mode") || exit 1
  for rep in $(seq "${REPS:-2}"); do
    for data in ${DATASETS:-random heldout}; do
      echo "== $mode $data $rep"
      python3 -m hyspec_jax.bench.serve_load --url "http://127.0.0.1:$PORT" "${LOAD[@]}" --dataset "$data" \
        --json "$RES/serve_load_${mode}_${data}_$rep.json" 2>&1 | tail -8
    done
  done
  kill -TERM "$(cat "$RES/server_$mode.log.pid")"
  wait
done
tar czf "$OUT/width_serve_load.tgz" -C "$RES" .
