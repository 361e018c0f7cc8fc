#!/usr/bin/env bash
# The shipped drafter's recipe (checkpoints/default/drafter): distillation data, DSpark, a ReaDy source-layer
# ablation (stage 1, four choices run side by side on the one GPU), ReaDy stage 2 on the best choice and the
# no-state control (Table 2) side by side. About 9 minutes on one H200.
#
#   train/recipes/drafter_h200.sh RUN_DIR          # needs train/data/distill/prompts.npz
#                                                  # (hyspec build-distill --out train/data/distill --prompts-only
#                                                  #  --per-domain 1536) and the corpus validation shards
# Budgets (seconds, compiles included) and sizes can be overridden for a CPU smoke run:
#   DSPARK_S=190 READY1_S=95 READY2_S=110 GEN_LEN=224 SEQ_LEN=256 BATCH=32 ANCHORS=64 DTYPE=auto
set -euo pipefail
RUN=${1:?usage: drafter_h200.sh RUN_DIR}
TARGET=${TARGET:-checkpoints/default}
CORPUS=${CORPUS:-train/data/corpus}
PROMPTS=${PROMPTS:-train/data/distill/prompts.npz}
DSPARK_S=${DSPARK_S:-190}; READY1_S=${READY1_S:-95}; READY2_S=${READY2_S:-110}
GEN_LEN=${GEN_LEN:-224}; SEQ_LEN=${SEQ_LEN:-256}; BATCH=${BATCH:-32}; ANCHORS=${ANCHORS:-64}; DTYPE=${DTYPE:-auto}
GEN_BATCH=${GEN_BATCH:-1536}
ABLATION=${ABLATION:-"2 6|0 1|5 6|1 4"}
H=(python3 -m hyspec_jax.train.cli_train)
export XLA_PYTHON_CLIENT_PREALLOCATE=false    # several trainers share the GPU
mkdir -p "$RUN"
COMMON=(--target "$TARGET" --corpus "$CORPUS" --data "$RUN/distill" --seq-len "$SEQ_LEN" --batch-size "$BATCH"
        --anchors "$ANCHORS" --steps 1000000 --dtype "$DTYPE" --eval-every 0 --ckpt-every 1000000)

"${H[@]}" build-distill --target "$TARGET" --prompts "$PROMPTS" --out "$RUN/distill" --gen-len "$GEN_LEN" \
    --batch-size "$GEN_BATCH"

"${H[@]}" train-drafter "${COMMON[@]}" --out "$RUN/dspark" --stage dspark --layers 1 --tap-layers 1 3 5 \
    --intermediate-size 768 --markov-rank 32 --block-size 7 --time-budget "$DSPARK_S" > "$RUN/dspark.log" 2>&1

IFS='|' read -r -a CHOICES <<< "$ABLATION"
pids=()
for c in "${CHOICES[@]}"; do
  tag=${c// /_}
  "${H[@]}" train-drafter "${COMMON[@]}" --out "$RUN/ready1_$tag" --stage ready1 --init "$RUN/dspark/drafter" \
      --source-layers $c --time-budget "$READY1_S" > "$RUN/ready1_$tag.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done

BEST=$(python3 - "$RUN" <<'PY'
import json, sys, pathlib
run = pathlib.Path(sys.argv[1])
rows = {}
for d in sorted(run.glob("ready1_*")):
    if (d / "summary.json").is_file():
        val = json.loads((d / "summary.json").read_text())["val"]
        rows[d.name] = sum(v["tau"] for v in val.values()) / len(val)
dspark = json.loads((run / "dspark" / "summary.json").read_text())["val"]
rows["dspark"] = sum(v["tau"] for v in dspark.values()) / len(dspark)
(run / "ablation.json").write_text(json.dumps(rows, indent=1) + "\n")
best = max((k for k in rows if k != "dspark"), key=rows.get)
print(best)
PY
)
echo "ReaDy source layers: best $BEST ($(cat "$RUN/ablation.json" | tr -d '\n '))"

"${H[@]}" train-drafter "${COMMON[@]}" --out "$RUN/ready2" --stage ready2 --init "$RUN/$BEST/drafter" \
    --export-dtype bfloat16 --time-budget "$READY2_S" > "$RUN/ready2.log" 2>&1 &
p1=$!
"${H[@]}" train-drafter "${COMMON[@]}" --out "$RUN/nostate" --stage ready2 --init "$RUN/$BEST/drafter" \
    --no-state --time-budget "$READY2_S" > "$RUN/nostate.log" 2>&1 &
p2=$!
wait $p1; wait $p2
echo "drafter: $RUN/ready2/drafter"
