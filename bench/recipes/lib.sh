# Sourced by the bench recipes (from the repository root): their shared set-up.
# - OUT (default: $OUT on the device machine, else ./out), PROMPTS / REPEATS / MAX_TOKENS (8 / 3 / 96);
# - H: the hyspec CLI; WIDE_TREE: the GPU default (wide) tree with the Pallas kernels where supported;
# - running from the tree: the GPU machine has no network and the package need not be installed there, so the
#   application folders are mapped under hyspec_jax as the wheel does (pyproject.toml package-dir). The
#   installed check runs outside the tree, where the checkout itself cannot answer it.
OUT=${OUT:-out}; mkdir -p "$OUT"
PROMPTS=${PROMPTS:-8}; REPEATS=${REPEATS:-3}; MAX_TOKENS=${MAX_TOKENS:-96}
export PYTHONUNBUFFERED=1
if ! (cd / && python3 -c "import hyspec_jax.bench") 2>/dev/null; then
  for d in train serve bench pallas_kernels; do [ -e "hyspec_jax/$d" ] || ln -s "$PWD/$d" "hyspec_jax/$d"; done
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
H=(python3 -m hyspec_jax.cli)
WIDE_TREE=(--tree-depth 7 --tree-topk 8 --tree-beam 16 --verify-nodes 32)
