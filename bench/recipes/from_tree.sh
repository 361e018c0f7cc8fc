# Sourced by the bench recipes: the GPU machine has no network and the package need not be installed there, so
# map the application folders under hyspec_jax as the wheel does (pyproject.toml package-dir) and run from the
# tree. The installed check runs outside the tree, where the checkout itself cannot answer it.
if ! (cd / && python3 -c "import hyspec_jax.bench") 2>/dev/null; then
  for d in train serve bench; do [ -e "hyspec_jax/$d" ] || ln -s "$PWD/$d" "hyspec_jax/$d"; done
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
