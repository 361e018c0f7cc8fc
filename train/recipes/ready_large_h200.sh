#!/usr/bin/env bash
# [ready-scale] item 4: whether ReaDy's reader gains on a target about ten times the embedded one. Trains the
# "large" preset (212M parameters, the embedded model's layout scaled: 16 layers = 12 GDN + 4 attention) on the
# offline corpus, then runs the positive control of ready_control_h200.sh on it: DSpark with taps 3, 8, 13 (the
# last GDN layer, 14, untapped) on pack A, a reader of layer 14 (and of 10 and 14) on pack B disjoint from A,
# stage 2 and the state-free LoRA control, and the engine's tau with its own state, another request's and none.
#
#   train/recipes/ready_large_h200.sh RUN_DIR        # needs the corpus (train/data/corpus, `hyspec build-corpus`)
# Steps (STEPS, default "target data dspark reader tau"), each resumable on a warm machine in its own device call
# (one H200: target ≈ TARGET_S + 1 min, data ≈ 2 min, dspark ≈ DSPARK_S + 1 min, reader ≈ 6 min, tau ≈ 3 min; on
# the embedded target reader took 7 min and tau 4 min on one H100, so give reader and tau a call each):
#   target  hyspec train-target --preset PRESET for TARGET_S training seconds, at most CALL_S of them in one call
#           (--call-limit: it checkpoints and stops; the same step in the next call resumes — the total steps are
#           fixed by the first call's measured rate); once finished, RUN/target/hf and RUN/target_report.json
#           (tokens/s, MFU against the dense bf16 peak, validation loss per domain)
#   data dspark reader tau    ready_control_h200.sh with TARGET=RUN/target/hf (its knobs pass through)
# A CPU smoke run (about 8 minutes on 2 cores):
#   PRESET=tiny TARGET_S=30 TBATCH=4 TSEQ=64 TAPS="1 2" READER="--source-layers 2 --ce-weight 0.1 --l1-weight 0.9"
#   PER_DOMAIN=4 GEN_LEN=16 SEQ_LEN=24 BATCH=4 ANCHORS=4 GEN_BATCH=16 VARIANTS=1 DSPARK_S=15 READY1_S=10 READY2_S=10
#   EVAL_WINDOWS=4 DTYPE=float32 SWAP_BATCH=2 DRAFTER="--layers 1 --intermediate-size 64 --markov-rank 4"
#   E2E="--prompts-per-domain 1 --repeats 1 --max-tokens 8 --tree-depth 2 --tree-topk 2 --tree-beam 2 --verify-nodes 4
#   --kernels auto" train/recipes/ready_large_h200.sh DIR
set -euo pipefail
RUN=${1:?usage: ready_large_h200.sh RUN_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
CORPUS=${CORPUS:-train/data/corpus}
PRESET=${PRESET:-large}; TARGET_S=${TARGET_S:-720}; CALL_S=${CALL_S:-540}
TBATCH=${TBATCH:-64}; TSEQ=${TSEQ:-512}; TLR=${TLR:-1e-3}; TWARMUP=${TWARMUP:-200}
STEPS=${STEPS:-target data dspark reader tau}
mkdir -p "$RUN"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

if [[ " $STEPS " == *" target "* ]]; then
  python3 -m hyspec_jax.train.cli_train train-target --corpus "$CORPUS" --out "$RUN/target" --preset "$PRESET" \
      --batch-size "$TBATCH" --seq-len "$TSEQ" --lr "$TLR" --warmup "$TWARMUP" --steps 1000000 \
      --time-budget "$TARGET_S" --call-limit "$CALL_S" --ckpt-every 200 --eval-every 0 --export-dtype bfloat16 \
      >> "$RUN/target.log" 2>&1
  python3 - "$RUN" <<'PY' || exit 0
import json, pathlib, sys
run = pathlib.Path(sys.argv[1])
s = json.loads((run / "target" / "summary.json").read_text())
if not s["finished"]:
    print(f"target: step {s['step']} of {s['total_steps']}; run STEPS=target again to resume")
    sys.exit(1)
start = next(json.loads(l) for l in (run / "target" / "metrics.jsonl").read_text().splitlines() if '"start"' in l)
val = s["val"]
out = {"num_params": s["num_params"], "steps": s["step"], "tokens_per_s": round(s["tokens_per_s"] or 0, 1),
       "flops_per_token": s["flops_per_token"], "mfu": s["mfu"], "device_kind": start["device_kind"],
       "devices": start["devices"], "compute_dtype": start["compute_dtype"], "train_tokens": start["train_tokens"],
       "trained_tokens": s["step"] * start["train_config"]["batch_size"] * start["train_config"]["seq_len"],
       "val_loss": {d: v["loss"] for d, v in val.items()},
       "val_loss_mean": round(sum(v["loss"] for v in val.values()) / len(val), 4)}
(run / "target_report.json").write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps(out))
PY
  stamp "target: $RUN/target/hf"
fi

rest=$(for s in data dspark reader tau; do [[ " $STEPS " == *" $s "* ]] && printf '%s ' "$s"; done)
if [ -n "$rest" ]; then
  [ -f "$RUN/target/hf/config.json" ] || { echo "no $RUN/target/hf: run STEPS=target first" >&2; exit 1; }
  TARGET="$RUN/target/hf" SHIPPED="" CORPUS="$CORPUS" TAPS="${TAPS:-3 8 13}" \
      READER="${READER:-"--source-layers 14 --ce-weight 0.1 --l1-weight 0.9|--source-layers 10 14 --ce-weight 0.1 --l1-weight 0.9"}" \
      STEPS="$rest" bash "$HERE/ready_control_h200.sh" "$RUN"
fi
