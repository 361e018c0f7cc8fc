#!/usr/bin/env bash
# [verify-fast] on one GPU (H100 or H200). STEPS (default "layer"; each step takes 3-6 minutes, so a 10-minute device
# call holds "layer" alone, or two of the others):
#   layer    `hyspec bench gdn-layer`: the verify's tree solve and the decoding step at the model's inputs, their
#            alternatives, XLA, and SGLang's kernels beside them
#   profile  `hyspec bench profile-scale` of decode and verify at B 1 / 8, N 8 / 32: the in-model GDN time per
#            layer, kernels per call, each program against its floor
#   round    `hyspec bench round-scale` (tree-ready T_round / T_dec) at B 1 / 8 / 32 (ROUND_BATCH), N 8 / 32
#   tests    the GPU twins of the kernel tests, where pytest is installed
# profile's PROFILE_BATCH, PROFILE_TIMEOUT and PROFILE_HLO (XLA's optimized HLO of the decoding steps).
# layer's LAYER_CONFIGS, DECODE_BATCHES ('' for none), LAYER_VARIANTS (a regex) and LAYER_TIMEOUT narrow it to fit
# beside other steps in one call.
# The SGLang peer: the one kernel file of the sglang 0.5.23 wheel, zipped under .peer/ (ignored; carry it):
#   here (repository root):  mkdir -p .peer/sgl && pip download --no-deps sglang==0.5.23 -d .peer/sgl && \
#            (cd .peer/sgl && unzip -q sglang-*.whl sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py \
#             && zip -q ../sglang-0.5.23-verifier.zip sglang/kernels/ops/attention/linear/*.py) && rm -rf .peer/sgl
# Usage (repository root, device machine): STEPS="layer round" bash bench/recipes/verify_fast_gpu.sh
source bench/recipes/lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import flax, chex, optax, tqdm; print('imports ok')" || exit 1
PEER=${PEER:-.peer/sglang-0.5.23-verifier.zip}
JAX_CACHE=${JAX_CACHE:-.jax_cache}      # the compile cache (ignored by git, so it never travels)
[ -e "$PEER" ] || PEER=
for step in ${STEPS:-layer}; do
  case $step in
    layer)    # JAX takes half the GPU here: the peer's torch allocations need the rest
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout ${LAYER_TIMEOUT:-540} "${H[@]}" bench gdn-layer \
        --configs ${LAYER_CONFIGS:-1:8,1:32,8:8,8:32,32:8} --decode-batches "${DECODE_BATCHES-1,8,32}" \
        ${LAYER_VARIANTS:+--variants "$LAYER_VARIANTS"} ${PEER:+--sglang-wheel "$PEER"} \
        --json "$OUT/gdn_layer.json" 2>&1 | tail -45 ;;
    profile)   # PROFILE_HLO=1: also XLA's optimized HLO of the decoding step (each batch), gzipped under $OUT
      [ -n "${PROFILE_HLO:-}" ] && HLO_DIR=$(mktemp -d) && export XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$HLO_DIR --xla_dump_hlo_as_text \
        --xla_dump_hlo_module_re=jit__extend"
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout ${PROFILE_TIMEOUT:-290} "${H[@]}" bench profile-scale \
        --batch ${PROFILE_BATCH:-1,8} --nodes 8,32 \
        --compile-workers 1 --max-seconds $(( ${PROFILE_TIMEOUT:-290} - 50 )) --compile-cache "$JAX_CACHE" --no-progress \
        --json "$OUT/profile_scale.json" 2>&1 | tail -12
      if [ -n "${PROFILE_HLO:-}" ]; then
        i=0; for f in "$HLO_DIR"/*jit__extend*after_optimizations.txt; do
          [ -e "$f" ] && gzip -c "$f" > "$OUT/decode_hlo_$i.txt.gz"; i=$((i + 1)); done
        unset XLA_FLAGS; fi ;;
    round)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 320 "${H[@]}" bench round-scale --batch ${ROUND_BATCH:-1,8,32} --nodes 8,32 --no-phases \
        --compile-workers 2 --max-seconds 270 --compile-cache "$JAX_CACHE" --no-progress \
        --json "$OUT/round_scale.json" 2>&1 | tail -14 ;;
    tests)
      python3 -c "import pytest" 2>/dev/null && timeout 200 python3 -m pytest -q -x -p no:cacheprovider \
        tests/test_kernels.py tests/test_decode_kernel.py -k gpu 2>&1 | tail -6 ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
