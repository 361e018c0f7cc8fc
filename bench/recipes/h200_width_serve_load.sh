#!/usr/bin/env bash
# On the H200: the verify width chosen each round (hyspec_jax/spec/width.py) end to end through the server.
# Step calibrate: `hyspec calibrate` times the engine's own round at every width bucket (1 = plain decoding .. 32)
#   for the server's bucket (SLOTS slots; KV ≥ max-model-len + the round's overshoot) into $TABLE.
# Step serve: `serve_load` (greedy, 64 tokens a request) of tree-ready — the width then chosen each round from
#   $TABLE — against plain decoding (ar), at concurrency 1 / 4 / 8 / 16 / 32 / 64, on random-word and held-out
#   prompts; the modes' servers up side by side, one client driving them in turns level by level (INTERLEAVE=1,
#   the default: each level's results of the servers are seconds apart; 0: a whole pass of one server, then the
#   next), REPS passes. --spec-mode is
#   given: without it the embedded drafter's recommended_modes.json decodes plainly above its serve_max_slots.
# The server's packages travel as wheels, the weights packed (bench/recipes/device_pack.sh):
#   here:           bash bench/recipes/serve_wheels.sh download; bash bench/recipes/device_pack.sh pack
#                   (then carry .whl and .devpack; on the H200 first `bash bench/recipes/device_pack.sh unpack`)
#   on the H200:    bash bench/recipes/h200_width_serve_load.sh          (both steps in one command), or, to stay
#                   under a 10-minute command, STEPS=calibrate, then STEPS=serve on the same machine ($TABLE is
#                   under the ignored out/, which a device call keeps between calls on a warm machine; so is JAX's
#                   compilation cache, out/jax_cache, so a second serve step starts its servers from it).
# Knobs: STEPS ("calibrate serve"), TABLE (out/hyspec_width_table.json; "none": the server's default, the embedded
# model's shipped table, and where that holds no round times for the bucket the server times its widths at
# start-up, `--startup-calibration`; serve only), SLOTS (64), CAL_BATCH (slots calibrated,
# default SLOTS; e.g. "1,4,16,64": also the rounds of the server's decoding buckets), MODES ("ar tree-ready"),
# DATASETS ("random heldout"), REPS (1), REP0 (0: the passes are numbered REP0+1..REP0+REPS, so a later call
# with the same RES adds passes beside earlier ones), CONC (the concurrency levels), REQUESTS (64 a level),
# WAVES (0: with K, at least K x concurrency requests a level, so the 64-request level is not one wave), INTERLEAVE
# (1: see above; the files are then serve_load_all_DATA_N.json, their rows named by server),
# LOAD_TOKENS (64: new tokens a request), LEN (1024: --max-model-len),
# PREFILL_CHUNK (128: prompt tokens per prefill call; one call runs between decoding steps, so a burst of prompts
# is admitted over about its tokens / PREFILL_CHUNK steps), RES (where the files gather; a fresh temporary
# folder), SPEC_EXTRA (more speculative options for calibrate and the server, e.g. "--packed-widths": the
# batch-wide budgets family, its own entries in the same table), SERVE_EXTRA (more options for every server, ar
# included, e.g. "--decode-buckets 1,4,8,16"), BASE (another checkout's root, e.g.
# `git archive REF hyspec_jax serve train pallas_kernels bench/recipes $(git ls-files 'bench/*.py') | tar x -C
# .devpack/base` made here and carried with .devpack: each speculative mode also
# runs from it, side by side, as "base-MODE" — an A/B of two versions of the code; programs the two share start from
# the compilation cache the other filled, since JAX keys it by the program, not by paths; serve-compare then names the
# modes by file and also divides each mode by its base), VARIANT ("LABEL=FLAGS": each speculative mode also runs
# from this checkout with FLAGS added, side by side, as "LABEL-MODE", e.g. VARIANT="b8=--decode-buckets 1,4,8,16";
# interleaved only; serve-compare then also divides each mode's variant by the mode). Each command's files
# (calibration, table, server logs, serve_load JSON) come back in one archive,
# $OUT/width_<steps>_<modes>_t<LOAD_TOKENS>_p<first>-<last pass>.tgz.
set -uo pipefail
source bench/recipes/serve_wheels.sh install .whl || exit 1
source bench/recipes/lib.sh
STEPS=${STEPS:-calibrate serve}; MODES=${MODES:-ar tree-ready}; TABLE=${TABLE:-out/hyspec_width_table.json}
if [ "$TABLE" != none ]; then     # none: the servers' default table (see above)
  mkdir -p "$(dirname "$TABLE")"; TABLE=$(realpath "$(dirname "$TABLE")")/$(basename "$TABLE")   # read from BASE too
fi
SLOTS=${SLOTS:-64}; LEN=${LEN:-1024}; RES=${RES:-$(mktemp -d)}; mkdir -p "$RES"
export HYSPEC_JAX_CACHE=${HYSPEC_JAX_CACHE:-$PWD/out/jax_cache}     # kept between calls, like $TABLE
if [[ " $STEPS " == *" calibrate "* ]]; then
  [ "$TABLE" != none ] || { echo "STEPS=calibrate writes a table: give TABLE a file" >&2; exit 1; }
  "${H[@]}" calibrate --spec-mode tree-ready --batch "${CAL_BATCH:-$SLOTS}" --kv-len $((LEN + 16)) --nodes 1,32 --repeats 20 ${SPEC_EXTRA:-} \
    --out "$TABLE" --json > "$RES/calibrate.json" || exit 1
  cp "$TABLE" "$RES/budget_table.json"
fi
if [[ " $STEPS " == *" serve "* ]]; then
  [ "$TABLE" = none ] || [ -f "$TABLE" ] || { echo "no $TABLE: run STEPS=calibrate first, or TABLE=none" >&2; exit 1; }
  # the servers share one GPU: 0.8 of its memory between them (each needs room beside its pool for XLA's CUDA
  # graphs: three servers at 0.4 each ran out of it at their first requests)
  NSERVERS=0
  for mode in $MODES; do
    NSERVERS=$((NSERVERS + 1)); if [ -n "${BASE:-}" ] && [ "$mode" != ar ]; then NSERVERS=$((NSERVERS + 1)); fi
    if [ -n "${VARIANT:-}" ] && [ "$mode" != ar ]; then NSERVERS=$((NSERVERS + 1)); fi
  done
  export XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.8 / $NSERVERS, 3))")
  SERVE=(--port 0 --max-batch "$SLOTS" --max-queue 256 --max-model-len $LEN --prefill-chunk "${PREFILL_CHUNK:-128}"
         ${SERVE_EXTRA:-})
  [ "$TABLE" = none ] || SERVE+=(--budget-table "$TABLE")
  LOAD=(--concurrency "${CONC:-1,4,8,16,32,64}" --num-requests "${REQUESTS:-64}" --waves "${WAVES:-0}"
        --max-tokens "${LOAD_TOKENS:-64}")
  # every mode's server up side by side (started one after another, so their compiles do not overlap), then the
  # passes alternate between them: a drift of the machine moves every mode alike
  declare -A PORTS
  LABELS=()
  if [ -n "${VARIANT:-}" ]; then
    [[ "$VARIANT" == ?*=?* ]] || { echo "VARIANT must be LABEL=FLAGS, got '$VARIANT'" >&2; exit 1; }
    [ "${INTERLEAVE:-1}" = 1 ] || { echo "VARIANT needs INTERLEAVE=1" >&2; exit 1; }
    VLABEL=${VARIANT%%=*}; read -r -a VFLAGS <<< "${VARIANT#*=}"
  fi
  if [ -n "${BASE:-}" ]; then
    [ -d "$BASE/hyspec_jax" ] || { echo "BASE=$BASE holds no checkout (hyspec_jax/)" >&2; exit 1; }
    [ -e "$BASE/checkpoints" ] || ln -s "$PWD/checkpoints" "$BASE/checkpoints"
  fi
  for mode in $MODES; do
    extra=(); [ "$mode" != ar ] && extra=(${SPEC_EXTRA:-})
    PORTS[$mode]=$(start_server "$PWD" "$RES/server_$mode.log" "${SERVE[@]}" --spec-mode "$mode" "${extra[@]}") || exit 1
    LABELS+=("$mode")
    if [ -n "${BASE:-}" ] && [ "$mode" != ar ]; then
      PORTS[base-$mode]=$(start_server "$BASE" "$RES/server_base-$mode.log" "${SERVE[@]}" --spec-mode "$mode" \
        "${extra[@]}") || exit 1
      LABELS+=("base-$mode")
    fi
    if [ -n "${VARIANT:-}" ] && [ "$mode" != ar ]; then
      PORTS[$VLABEL-$mode]=$(start_server "$PWD" "$RES/server_$VLABEL-$mode.log" "${SERVE[@]}" --spec-mode "$mode" \
        "${extra[@]}" "${VFLAGS[@]}") || exit 1
      LABELS+=("$VLABEL-$mode")
    fi
  done
  URLS=(); for label in "${LABELS[@]}"; do URLS+=(--url "$label=http://127.0.0.1:${PORTS[$label]}"); done
  LEVELS=$(echo "${CONC:-1,4,8,16,32,64}" | tr ',' '\n' | grep -c .)
  for rep in $(seq $((${REP0:-0} + 1)) $((${REP0:-0} + ${REPS:-1}))); do
    for data in ${DATASETS:-random heldout}; do
      if [ "${INTERLEAVE:-1}" = 1 ]; then       # one client, the servers taking turns level by level
        echo "== ${LABELS[*]} $data $rep"
        python3 -m hyspec_jax.bench.serve_load "${URLS[@]}" "${LOAD[@]}" --dataset "$data" \
          --json "$RES/serve_load_all_${data}_$rep.json" 2>&1 | tail -$((1 + LEVELS * ${#LABELS[@]}))
        continue
      fi
      for label in "${LABELS[@]}"; do
        echo "== $label $data $rep"
        python3 -m hyspec_jax.bench.serve_load --url "http://127.0.0.1:${PORTS[$label]}" "${LOAD[@]}" --dataset "$data" \
          --json "$RES/serve_load_${label}_${data}_$rep.json" 2>&1 | tail -8
      done
    done
  done
  for label in "${LABELS[@]}"; do kill -TERM "$(cat "$RES/server_$label.log.pid")"; done
  wait
  # every pass so far under RES, each mode divided by ar of the same pass (and, with BASE, by its base); the
  # interleaved files name their rows by label, the others by file name where BASE runs a mode twice
  BY=(); [ -n "${BASE:-}" ] && [ "${INTERLEAVE:-1}" != 1 ] && BY=(--mode-from-name)
  [[ " $MODES " == *" ar "* ]] && "${H[@]}" bench serve-compare "$RES"/serve_load_*.json "${BY[@]}" \
      --json "$RES/serve_compare.json" | tail -n +4
  if [ -n "${VARIANT:-}" ]; then
    for mode in $MODES; do
      [ "$mode" = ar ] && continue
      "${H[@]}" bench serve-compare "$RES"/serve_load_all_*.json --baseline "$mode" \
        --json "$RES/serve_compare_$VLABEL-$mode.json" | tail -n +4
    done
  fi
  if [ -n "${BASE:-}" ]; then
    for mode in $MODES; do
      [ "$mode" = ar ] && continue
      if [ "${INTERLEAVE:-1}" = 1 ]; then
        "${H[@]}" bench serve-compare "$RES"/serve_load_all_*.json --baseline "base-$mode" \
          --json "$RES/serve_compare_base-$mode.json" | tail -n +4
      else
        "${H[@]}" bench serve-compare "$RES/serve_load_${mode}"_*.json "$RES/serve_load_base-${mode}"_*.json \
          --mode-from-name --baseline "base-$mode" --json "$RES/serve_compare_base-$mode.json" | tail -n +4
      fi
    done
  fi
fi
# named by steps, modes, request length and passes, so two commands of one call do not overwrite each other's
tar czf "$OUT/width_$(echo "$STEPS" | tr ' ' '-')_$(echo "$MODES" | tr ' ' '-')_t${LOAD_TOKENS:-64}_p$((${REP0:-0} + 1))-$((${REP0:-0} + ${REPS:-1})).tgz" -C "$RES" .
