#!/usr/bin/env bash
# The server's Python packages as wheels that travel with a GPU run (the GPU machine has no network; its image
# lacks fastapi, starlette, uvicorn, pydantic, pydantic-core, ...; uvloop travels too: without it uvicorn runs on
# plain asyncio; httptools too: without it uvicorn speaks HTTP through h11, slower per streamed chunk). The versions
# are those of the project venv that passed tests/test_server.py; CPython 3.12, manylinux x86_64 (the GPU image's
# Python).
#   here (network):        bash bench/recipes/serve_wheels.sh download [DIR]     (default DIR: .whl)
#   on the GPU machine:    source bench/recipes/serve_wheels.sh install [DIR]    (installs into $SERVE_SITE, default
#                          .site/ of the repository, and
#                          puts it on PYTHONPATH; DIR must travel with the run: `carry` it)
WHEELS=(fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic_core==2.50.5
        annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing_extensions==4.16.0
        h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 httpx==0.29.0 httpcore==1.0.9 idna==3.21
        certifi==2026.10.19.post1 click==8.5.1 prometheus_client==0.26.0 Jinja2==3.1.6 MarkupSafe==3.0.4
        opentelemetry-api==1.45.3 uvloop==0.23.0 httptools==0.9.0)
_cmd=${1:-}
_dir=${2:-.whl}
export SERVE_SITE=${SERVE_SITE:-$PWD/.site}

start_server() {   # start_server ROOT LOG SERVE_ARGS... -> prints the port once the server at checkout ROOT listens
  local root=$1 log=$2; shift 2
  # each checkout imports its own code: only the installed packages are kept on the path
  (cd "$root" && export PYTHONPATH="$SERVE_SITE" && source bench/recipes/lib.sh && exec python3 -m hyspec_jax.serve "$@") \
    > "$log" 2>&1 &
  echo $! > "$log.pid"
  for _ in $(seq 600); do
    p=$(grep -o "on http://127.0.0.1:[0-9]*" "$log" | head -1 | grep -o "[0-9]*$") && [ -n "$p" ] && { echo "$p"; return; }
    kill -0 "$(cat "$log.pid")" 2>/dev/null || { tail -5 "$log" >&2; return 1; }
    sleep 1
  done
  return 1
}
case "$_cmd" in
  download)
    mkdir -p "$_dir"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d "$_dir" "${WHEELS[@]}" && ls "$_dir" ;;
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SERVE_SITE" \
      --find-links "$_dir" "$_dir"/*.whl && export PYTHONPATH="$SERVE_SITE${PYTHONPATH:+:$PYTHONPATH}" \
      && python3 -c "import fastapi, uvicorn, uvloop, httptools, pydantic, httpx, prometheus_client, jinja2" ;;
  *)
    echo "usage: serve_wheels.sh download|install [DIR]" >&2; false ;;
esac
