#!/usr/bin/env bash
# [ready-scale] item 1, the positive control in the paper's geometry: a DSpark drafter whose taps leave the last
# GDN layer untapped (1, 3, 5; the target's GDN layers are 0-2 and 4-6), trained on the shipped drafter's prompt
# pack (A); then ReaDy on it — stage 1 reading the untapped layer 6 and the two layers 4, 6 — trained on a fresh
# pack (B) whose windows overlap none of A's (`build-distill --exclude-prompts`), with DSpark's loss weights (CE 0.1
# + L1 0.9: in the shipped reader's retrain they beat the paper's CE 1.0 + L1 0.1) and the paper's learning rates;
# stage 2 and the state-free LoRA control (reader_h200.sh); and the engine's tau on the held-out prompts for
# DSpark(1,3,5), the reader fed its own state and another request's (`python -m experiments.reader_swap`), and the
# shipped DSpark(1,4,6).
#
#   train/recipes/ready_control_h200.sh RUN_DIR        # needs the corpus (or PROMPTS_A / PROMPTS_B packs and
#                                                      # the validation shards' first EVAL_WINDOWS windows)
# Steps (STEPS, default "data dspark reader tau"), each resumable on a warm machine in its own device call:
#   data    the two prompt packs, then A's distillation data (B's is built by reader_h200.sh)
#   dspark  DSpark(1,3,5) on A for DSPARK_S training seconds
#   reader  reader_h200.sh on it with B (READER: its stage-1 choices)
#   tau     bench e2e: chain / ready with the new drafter (own and swapped state, batch SWAP_BATCH), the state-free
#           LoRA control (chain: its LoRA merged, no reader), chain / ready with the shipped drafter
#           (RUN/tau_*.{json,md}; the table that paired them by domain, bench/ready_control.py, was a one-time
#           report: git history has it)
# Sizes and budgets as drafter_h200.sh / reader_h200.sh (PER_DOMAIN 1536 a domain: the shipped pack's size).
# Long contexts ([ready-scale] item 2's training side): PROMPT_LEN=256 GEN_LEN=256 SEQ_LEN=512, and E2E with
# --prompts bench/data/heldout_prompts_L256.npz (or _L448) for the engine's tau at those prefixes.
# A CPU smoke run (about 6 minutes on 2 cores):
#   PER_DOMAIN=4 GEN_LEN=16 SEQ_LEN=24 BATCH=4 ANCHORS=4 GEN_BATCH=16 VARIANTS=1 DSPARK_S=15 READY1_S=10
#   READY2_S=10 EVAL_WINDOWS=4 DTYPE=float32 SWAP_BATCH=2 E2E="--prompts-per-domain 1 --repeats 1 --max-tokens 8
#   --tree-depth 2 --tree-topk 2 --tree-beam 2 --verify-nodes 4 --kernels auto" train/recipes/ready_control_h200.sh DIR
set -euo pipefail
RUN=${1:?usage: ready_control_h200.sh RUN_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
TARGET=${TARGET:-checkpoints/default}
SHIPPED=${SHIPPED-checkpoints/default/drafter}     # empty: no shipped drafter to compare
TAPS=${TAPS:-1 3 5}                                  # the DSpark taps
DRAFTER=${DRAFTER:-"--layers 1 --intermediate-size 768 --markov-rank 32"}   # the DSpark size (the shipped one's)
CORPUS=${CORPUS:-train/data/corpus}
PER_DOMAIN=${PER_DOMAIN:-1536}
PROMPTS_A=${PROMPTS_A:-$RUN/prompts_a/prompts.npz}
PROMPTS_B=${PROMPTS_B:-$RUN/prompts_b/prompts.npz}
NGPU=${NGPU:-1}
DSPARK_S=${DSPARK_S:-220}
PROMPT_LEN=${PROMPT_LEN:-32}; GEN_LEN=${GEN_LEN:-224}; SEQ_LEN=${SEQ_LEN:-256}; BATCH=${BATCH:-64}; ANCHORS=${ANCHORS:-64}; DTYPE=${DTYPE:-auto}
GEN_BATCH=${GEN_BATCH:-1536}; VARIANTS=${VARIANTS:-4}
READER=${READER:-"--source-layers 6 --ce-weight 0.1 --l1-weight 0.9|--source-layers 4 6 --ce-weight 0.1 --l1-weight 0.9"}
E2E=${E2E:-"--prompts-per-domain 8 --repeats 1 --max-tokens 96 --tree-depth 7 --tree-topk 8 --tree-beam 16 --verify-nodes 32 --kernels auto"}
SWAP_BATCH=${SWAP_BATCH:-4}
STEPS=${STEPS:-data dspark reader tau}
H=(python3 -m hyspec_jax.train.cli_train)
mkdir -p "$RUN"
. "$HERE/lib.sh"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }

if has data; then
  # A: the shipped drafter's pack (build-distill's defaults, seed 0); B: seed 1, clear of A's windows
  [ -f "$PROMPTS_A" ] || "${H[@]}" build-distill --corpus "$CORPUS" --out "$(dirname "$PROMPTS_A")" --prompts-only \
      --per-domain "$PER_DOMAIN" --prompt-len "$PROMPT_LEN" --seed 0
  [ -f "$PROMPTS_B" ] || "${H[@]}" build-distill --corpus "$CORPUS" --out "$(dirname "$PROMPTS_B")" --prompts-only \
      --per-domain "$PER_DOMAIN" --prompt-len "$PROMPT_LEN" --seed 1 --exclude-prompts "$PROMPTS_A"
  PROMPTS=$PROMPTS_A build_distill_data     # -> RUN/distill
  stamp "data: packs A, B; A's distillation data"
fi

if has dspark; then
  "${H[@]}" train-drafter --target "$TARGET" --corpus "$CORPUS" --data "$RUN/distill" --seq-len "$SEQ_LEN" \
      --batch-size "$BATCH" --anchors "$ANCHORS" --steps 1000000 --dtype "$DTYPE" --eval-every 0 \
      --ckpt-every 1000000 --out "$RUN/dspark" --stage dspark $DRAFTER \
      --block-size 7 --time-budget "$DSPARK_S" --tap-layers $TAPS > "$RUN/dspark.log" 2>&1
  stamp "DSpark($TAPS): $(mean_tau dspark)"
fi

if has reader; then
  BASE="$RUN/dspark/drafter" PROMPTS="$PROMPTS_B" READER="$READER" E2E="$E2E" \
      bash "$HERE/reader_h200.sh" "$RUN/reader"
  stamp "reader: $RUN/reader/ready2/drafter"
fi

if has tau; then
  E=(python3 -m hyspec_jax.cli bench e2e --no-plots --model "$TARGET" $E2E)
  SWAP=(env PYTHONPATH="$HERE/../..${PYTHONPATH:+:$PYTHONPATH}" python3 -m experiments.reader_swap --no-plots --model "$TARGET" $E2E)
  "${E[@]}" --json "$RUN/tau_own.json" --drafter "$RUN/reader/ready2/drafter" --batch 1 "$SWAP_BATCH" \
      --modes ar chain ready 2>&1 | tail -n 8
  "${SWAP[@]}" --json "$RUN/tau_swapped.json" --drafter "$RUN/reader/ready2/drafter" --batch "$SWAP_BATCH" \
      --modes ar ready 2>&1 | tail -n 6
  # the state-free control: the stage-2 LoRA merged into the weights, no reader (so it drafts as chain)
  "${E[@]}" --json "$RUN/tau_nostate.json" --drafter "$RUN/reader/nostate/drafter" --batch 1 \
      --modes ar chain 2>&1 | tail -n 6
  [ -z "$SHIPPED" ] || "${E[@]}" --json "$RUN/tau_shipped.json" --drafter "$SHIPPED" --batch 1 --modes ar chain ready \
      2>&1 | tail -n 8
  stamp "tau: $(echo "$RUN"/tau_*.json)"
fi
