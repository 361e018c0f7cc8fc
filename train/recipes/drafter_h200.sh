#!/usr/bin/env bash
# The shipped drafter's recipe (checkpoints/default/drafter): distillation data (every prompt continued VARIANTS
# times: once greedily, then forked by a few sampled tokens and continued greedily), DSpark choices side by
# side (tap layers, batch, lr), a ReaDy source-layer ablation (stage 1), ReaDy stage 2 on the best choice and
# the no-state control (Table 2). Runs of one stage go side by side: spread over NGPU GPUs (each with its share
# of the CPU cores), or sharing the one GPU. The defaults made the shipped drafter: 524 s on two H200s
# (NGPU=2). Budgets are training seconds per run; a larger set (VARIANTS=6, DSPARK_S=260) ran past a 570 s
# device limit in stage 2.
#
#   NGPU=2 train/recipes/drafter_h200.sh RUN_DIR   # needs train/data/distill/prompts.npz
#                                                  # (hyspec build-distill --out train/data/distill --prompts-only
#                                                  #  --per-domain 1536) and the corpus validation shards
# Budgets (seconds, compiles included) and sizes can be overridden, e.g. for a CPU smoke run:
#   DSPARK_S=220 READY1_S=75 READY2_S=85 GEN_LEN=224 SEQ_LEN=256 BATCH=64 ANCHORS=64 DTYPE=auto VARIANTS=4
# DSPARK: '|'-separated DSpark choices, each extra train-drafter arguments (the run dspark_<i> trains choice i)
set -euo pipefail
RUN=${1:?usage: drafter_h200.sh RUN_DIR}
TARGET=${TARGET:-checkpoints/default}
CORPUS=${CORPUS:-train/data/corpus}
PROMPTS=${PROMPTS:-train/data/distill/prompts.npz}
NGPU=${NGPU:-1}
DSPARK_S=${DSPARK_S:-220}; READY1_S=${READY1_S:-75}; READY2_S=${READY2_S:-85}
GEN_LEN=${GEN_LEN:-224}; SEQ_LEN=${SEQ_LEN:-256}; BATCH=${BATCH:-64}; ANCHORS=${ANCHORS:-64}; DTYPE=${DTYPE:-auto}
GEN_BATCH=${GEN_BATCH:-1536}; VARIANTS=${VARIANTS:-4}
DSPARK=${DSPARK:-"--tap-layers 1 3 5|--tap-layers 1 4 6"}
ABLATION=${ABLATION:-"2 6|0 1|5 6|1 4"}
H=(python3 -m hyspec_jax.train.cli_train)
export XLA_PYTHON_CLIENT_PREALLOCATE=false    # several trainers may share a GPU
mkdir -p "$RUN"
COMMON=(--target "$TARGET" --corpus "$CORPUS" --data "$RUN/distill" --seq-len "$SEQ_LEN" --batch-size "$BATCH"
        --anchors "$ANCHORS" --steps 1000000 --dtype "$DTYPE" --eval-every 0 --ckpt-every 1000000)

. "$(dirname "$0")/lib.sh"

# 1. distillation data: variants split over the GPUs, then joined (RUN/distill)
build_distill_data

# 2. DSpark, one run per choice
IFS='|' read -r -a DSPARK_CHOICES <<< "$DSPARK"
pids=(); names=(); i=0
for c in "${DSPARK_CHOICES[@]}"; do
  name=dspark_$i; names+=("$name"); echo "$c" > "$RUN/$name.args"
  on "$i" "${H[@]}" train-drafter "${COMMON[@]}" --out "$RUN/$name" --stage dspark --layers 1 \
      --intermediate-size 768 --markov-rank 32 --block-size 7 --time-budget "$DSPARK_S" $c > "$RUN/$name.log" 2>&1 &
  pids+=($!); i=$((i + 1))
done
for p in "${pids[@]}"; do wait "$p"; done
TAP_ROWS=$(mean_tau "${names[@]}")
BEST_DSPARK=$(best_of "$TAP_ROWS")
echo "DSpark: best $BEST_DSPARK: $(cat "$RUN/$BEST_DSPARK.args") ($TAP_ROWS)"

# 3. ReaDy stage 1: reader source-layer ablation on the best DSpark
IFS='|' read -r -a CHOICES <<< "$ABLATION"
pids=(); names=(); i=0
for c in "${CHOICES[@]}"; do
  name=ready1_${c// /_}; names+=("$name")
  on "$i" "${H[@]}" train-drafter "${COMMON[@]}" --out "$RUN/$name" --stage ready1 --init "$RUN/$BEST_DSPARK/drafter" \
      --source-layers $c --time-budget "$READY1_S" > "$RUN/$name.log" 2>&1 &
  pids+=($!); i=$((i + 1))
done
for p in "${pids[@]}"; do wait "$p"; done
READER_ROWS=$(mean_tau "${names[@]}")
BEST=$(best_of "$READER_ROWS")
python3 - "$RUN" "$TAP_ROWS" "$READER_ROWS" "$BEST_DSPARK" <<'PY'
import json, sys, pathlib
run, dsp, readers, best = pathlib.Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
choices = {k: {"args": (run / f"{k}.args").read_text().strip(), "tau_hat": v} for k, v in dsp.items()}
rows = dict(readers, dspark=dsp[best])
(run / "ablation.json").write_text(json.dumps({"dspark": choices, "dspark_best": best,
                                               "reader_source_layers": rows}, indent=1) + "\n")
PY
echo "ReaDy source layers: best $BEST ($READER_ROWS)"

# 4. ReaDy stage 2 on the best reader, and the no-state control
on 0 "${H[@]}" train-drafter "${COMMON[@]}" --out "$RUN/ready2" --stage ready2 --init "$RUN/$BEST/drafter" \
    --export-dtype bfloat16 --time-budget "$READY2_S" > "$RUN/ready2.log" 2>&1 &
p1=$!
on 1 "${H[@]}" train-drafter "${COMMON[@]}" --out "$RUN/nostate" --stage ready2 --init "$RUN/$BEST/drafter" \
    --no-state --time-budget "$READY2_S" > "$RUN/nostate.log" 2>&1 &
p2=$!
wait $p1; wait $p2
echo "drafter: $RUN/ready2/drafter"
