#!/usr/bin/env bash
# An MTP head for the embedded model (modes mtp / mtp-tree): `train-mtp` on corpus windows (DATA=DIR: on
# build-distill continuations instead) for MTP_S training seconds, written into a scratch copy of the target;
# the head's files (mtp.safetensors, config.json with its layer count, model.safetensors.index.json) and the
# run's metrics land in RUN_DIR/ship, ready to be copied into checkpoints/default.
#
#   train/recipes/mtp_h200.sh RUN_DIR        # needs the corpus (hyspec build-corpus --tokenizer checkpoints/default)
# On a GPU machine without the package installed: ln -sfn $PWD/train hyspec_jax/train; PYTHONPATH=$PWD.
# Budgets and sizes can be overridden, e.g. a CPU smoke run: MTP_S=20 SEQ_LEN=64 BATCH=4 DTYPE=float32
set -euo pipefail
RUN=${1:?usage: mtp_h200.sh RUN_DIR}
TARGET=${TARGET:-checkpoints/default}
CORPUS=${CORPUS:-train/data/corpus}
MTP_S=${MTP_S:-240}; SEQ_LEN=${SEQ_LEN:-512}; BATCH=${BATCH:-64}; LR=${LR:-1e-3}; DTYPE=${DTYPE:-auto}
# the recursive steps drafting runs (mtp-tree's depth 7), weighted by how often a step is reached; the target's own
# distribution as the label (greedy verification accepts its argmax)
DRAFT_STEPS=${DRAFT_STEPS:-7}; STEP_DECAY=${STEP_DECAY:-0.7}; DISTILL=${DISTILL:-1.0}
SCRATCH=(--from-scratch); [ "${FROM_SCRATCH:-1}" = 0 ] && SCRATCH=()    # FROM_SCRATCH=0: go on from TARGET's mtp.*
mkdir -p "$RUN/ship"
rm -rf "$RUN/model" && mkdir -p "$RUN/model"
cp "$TARGET"/*.json "$TARGET"/*.safetensors "$RUN/model/"       # the target only (no drafter/)
DATA_ARG=(); [ -n "${DATA:-}" ] && DATA_ARG=(--data "$DATA")
python3 -m hyspec_jax.train.cli_train train-mtp --target "$RUN/model" --corpus "$CORPUS" "${DATA_ARG[@]}" \
    --out "$RUN/train" --seq-len "$SEQ_LEN" --batch-size "$BATCH" --lr "$LR" --steps 1000000 \
    --time-budget "$MTP_S" --dtype "$DTYPE" --eval-every 0 --eval-windows 64 --ckpt-every 1000000 \
    --export-dtype bfloat16 "${SCRATCH[@]}" --install-into "$RUN/model" \
    --draft-steps "$DRAFT_STEPS" --step-decay "$STEP_DECAY" --distill "$DISTILL"
cp "$RUN/model/mtp.safetensors" "$RUN/model/config.json" "$RUN/model/model.safetensors.index.json" \
   "$RUN/train/metrics.jsonl" "$RUN/train/summary.json" "$RUN/ship/"
