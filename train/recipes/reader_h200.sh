#!/usr/bin/env bash
# ReaDy stages 1 and 2 on an existing DSpark drafter (default: the shipped one), without retraining DSpark:
# distillation data, stage-1 reader choices side by side (source layers, loss weights, learning rate), stage 2
# (reader + LoRA) on the best choice with its loss weights, the no-state control (LoRA alone, the paper's
# Table 2), and the engine's tau on the held-out prompts for chain / ready / tree / tree-ready with the new
# drafter (chain and tree use the unchanged DSpark weights, so they are the baseline of the same run).
# Runs of one stage share the GPU (or spread over NGPU GPUs). Budgets are training seconds per run.
#
#   train/recipes/reader_h200.sh RUN_DIR   # needs PROMPTS (hyspec build-distill --prompts-only) and the
#                                          # corpus validation shards (only the first EVAL_WINDOWS windows
#                                          # of each are read, so a trimmed copy does)
# READER: '|'-separated stage-1 choices, each extra train-drafter arguments; the first one also evaluates
# the untrained reader (== DSpark) on the same windows, the baseline of the table.
set -euo pipefail
RUN=${1:?usage: reader_h200.sh RUN_DIR}
TARGET=${TARGET:-checkpoints/default}
BASE=${BASE:-checkpoints/default/drafter}
CORPUS=${CORPUS:-train/data/corpus}
PROMPTS=${PROMPTS:-train/data/distill/prompts.npz}
NGPU=${NGPU:-1}
READY1_S=${READY1_S:-130}; READY2_S=${READY2_S:-90}
GEN_LEN=${GEN_LEN:-224}; SEQ_LEN=${SEQ_LEN:-256}; BATCH=${BATCH:-64}; ANCHORS=${ANCHORS:-64}; DTYPE=${DTYPE:-auto}
GEN_BATCH=${GEN_BATCH:-1536}; VARIANTS=${VARIANTS:-4}; EVAL_WINDOWS=${EVAL_WINDOWS:-64}
READER=${READER:-"--source-layers 5 6|--source-layers 5 6 --ce-weight 0.1 --l1-weight 0.9|--source-layers 5 6 --ce-weight 0.1 --l1-weight 0.9 --lr 1e-3|--source-layers 2 6 --ce-weight 0.1 --l1-weight 0.9 --lr 1e-3"}
E2E=${E2E:-"--prompts-per-domain 8 --repeats 1 --max-tokens 96 --tree-depth 7 --tree-topk 8 --tree-beam 16 --verify-nodes 32 --kernels auto"}
H=(python3 -m hyspec_jax.train.cli_train)
export XLA_PYTHON_CLIENT_PREALLOCATE=false    # several trainers share a GPU
mkdir -p "$RUN"
. "$(dirname "$0")/lib.sh"
COMMON=(--target "$TARGET" --corpus "$CORPUS" --data "$RUN/distill" --seq-len "$SEQ_LEN" --batch-size "$BATCH"
        --anchors "$ANCHORS" --steps 1000000 --dtype "$DTYPE" --ckpt-every 1000000 --eval-windows "$EVAL_WINDOWS")
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

# 1. distillation data: variants split over the GPUs, then joined (RUN/distill)
build_distill_data
stamp "distillation data"

# 2. stage 1: the reader alone on the frozen DSpark, one run per choice
IFS='|' read -r -a CHOICES <<< "$READER"
pids=(); names=(); i=0
for c in "${CHOICES[@]}"; do
  name=ready1_$i; names+=("$name"); echo "$c" > "$RUN/$name.args"
  ev=0; [ "$i" -eq 0 ] && ev=1000000          # the first run also evaluates step 0 (the untrained reader)
  on "$i" "${H[@]}" train-drafter "${COMMON[@]}" --eval-every "$ev" --out "$RUN/$name" --stage ready1 \
      --init "$BASE" --time-budget "$READY1_S" $c > "$RUN/$name.log" 2>&1 &
  pids+=($!); i=$((i + 1))
done
for p in "${pids[@]}"; do wait "$p"; done
ROWS=$(mean_tau "${names[@]}")
BEST=$(best_of "$ROWS")
python3 - "$RUN" "$ROWS" "$BEST" <<'PY'
import json, sys, pathlib
run, rows, best = pathlib.Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
start = [json.loads(l) for l in (run / "ready1_0" / "metrics.jsonl").read_text().splitlines()]
v0 = next(r["val"] for r in start if r.get("step") == 0 and "val" in r)
out = {"dspark_tau_hat": round(sum(v["tau"] for v in v0.values()) / len(v0), 4),
       "dspark_val": v0, "best": best,
       "ready1": {k: {"args": (run / f"{k}.args").read_text().strip(), "tau_hat": t,
                      "val": json.loads((run / k / "summary.json").read_text())["val"]} for k, t in rows.items()}}
(run / "reader_ablation.json").write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps({"dspark": out["dspark_tau_hat"], **rows}))
PY
stamp "stage 1: best $BEST: $(cat "$RUN/$BEST.args")"

# 3. stage 2 on the best reader with its loss weights, and the no-state control
LOSS=$(grep -oE -- '--(ce|l1)-weight [0-9.e-]+' "$RUN/$BEST.args" | tr '\n' ' ' || true)
on 0 "${H[@]}" train-drafter "${COMMON[@]}" --eval-every 0 --out "$RUN/ready2" --stage ready2 \
    --init "$RUN/$BEST/drafter" --export-dtype bfloat16 --time-budget "$READY2_S" $LOSS > "$RUN/ready2.log" 2>&1 &
p1=$!
on 1 "${H[@]}" train-drafter "${COMMON[@]}" --eval-every 0 --out "$RUN/nostate" --stage ready2 \
    --init "$RUN/$BEST/drafter" --no-state --time-budget "$READY2_S" $LOSS > "$RUN/nostate.log" 2>&1 &
p2=$!
wait $p1; wait $p2
stamp "stage 2: $(mean_tau ready2 nostate)"

# 4. the engine's tau with the new drafter on the held-out prompts (greedy, batch 1, output == ar checked)
python3 -m hyspec_jax.cli bench e2e --json "$RUN/e2e_reader.json" --model "$TARGET" --drafter "$RUN/ready2/drafter" --batch 1 \
    --modes ar chain ready tree tree-ready $E2E 2>&1 | tail -n 12
stamp "drafter: $RUN/ready2/drafter"
