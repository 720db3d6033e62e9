#!/usr/bin/env bash
# One GPU session's checks, under 8 minutes, in three stages that each run even if an
# earlier one failed:
#   1. python -m pytest -q tests/kernels                     (kernels compiled for the GPU)
#   2. benchmarks/gpu/bench_attention.py                     (paged decode bandwidth vs peak)
#   3. benchmarks/gpu/bench_e2e.py                           (~1B Llama decode tokens/s via weft.LLM:
#                                                             CUDA graphs vs eager vs transformers,
#                                                             3 rotating rounds; a host profile)
#   4. benchmarks/gpu/bench_e2e.py --kv-cache-dtype int8     (the same on the int8 KV cache, no HF)
# Results, with the device and versions, go to benchmarks/results/gpu.md (and to $OUT
# when the device runner sets it, with the logs). Exit status: 0 when every stage ran
# and passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/../.."

usage() {
  cat <<'EOF'
usage: benchmarks/gpu/run.sh [options]

  --python PY        Python with CUDA torch + triton (default: $PYTHON, else python3)
  --wheels DIR       pip install --no-index every wheel in DIR first (for packages the
                     GPU image lacks, e.g. structlog for weft.LLM); default: none
  --peak-tbps X      device peak memory bandwidth in TB/s for both benchmarks
                     (default: looked up by device name, e.g. H200 4.8)
  --skip-tests       skip stage 1 (pytest tests/kernels)
  --skip-attention   skip stage 2 (attention bandwidth benchmark)
  --skip-e2e         skip stages 3 and 4 (end-to-end benchmarks)
  --help             this text

Stage time limits: tests 150 s, attention 90 s, end-to-end 200 s, int8 end-to-end 100 s.
EOF
}

PY="${PYTHON:-python3}"
WHEELS=""
PEAK_ARGS=()
RUN_TESTS=1 RUN_ATTENTION=1 RUN_E2E=1
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --peak-tbps) PEAK_ARGS=(--peak-tbps "$2"); shift 2 ;;
    --skip-tests) RUN_TESTS=0; shift ;;
    --skip-attention) RUN_ATTENTION=0; shift ;;
    --skip-e2e) RUN_E2E=0; shift ;;
    --help|-h) usage; exit 0 ;;
    *) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
  esac
done

export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the kernels must compile for the GPU, not run interpreted
RESULTS=benchmarks/results
WORK="$RESULTS/gpu-run.tmp"  # ignored by git (benchmarks/results/*.tmp)
rm -rf "$WORK" && mkdir -p "$WORK"
STATUS=0

if [ -n "$WHEELS" ]; then
  "$PY" -m pip install --no-index --no-deps "$WHEELS"/*.whl 2>&1 | tail -3
fi

stage() {  # stage NAME SECONDS CMD...: run with a time limit, log to $WORK/NAME.log
  local name="$1" limit="$2"; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$name: exit $rc after $((SECONDS - start)) s" | tee -a "$WORK/summary.txt"
  [ "$rc" -eq 0 ] || STATUS=1
  return 0
}

if [ "$RUN_TESTS" = 1 ]; then
  XDIST=()  # parallel workers compile the many kernel variants in parallel
  if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n 8); fi
  stage tests 150 "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" tests/kernels
fi
if [ "$RUN_ATTENTION" = 1 ]; then
  stage attention 90 "$PY" benchmarks/gpu/bench_attention.py "${PEAK_ARGS[@]}" --out "$WORK/attention.md"
fi
if [ "$RUN_E2E" = 1 ]; then
  if "$PY" -c "import weft.llm" 2>"$WORK/e2e-import.log"; then
    stage e2e 200 "$PY" benchmarks/gpu/bench_e2e.py "${PEAK_ARGS[@]}" --out "$WORK/e2e.md" \
      --profile "$WORK/e2e-profile.txt"
    stage e2e-int8 100 "$PY" benchmarks/gpu/bench_e2e.py "${PEAK_ARGS[@]}" --out "$WORK/e2e-int8.md" \
      --kv-cache-dtype int8 --no-baseline
  else
    echo "e2e: not run, weft.llm does not import ($(tail -1 "$WORK/e2e-import.log")); see --wheels" \
      | tee -a "$WORK/summary.txt"
    STATUS=1
  fi
fi

{
  echo "# GPU results"
  echo
  echo "Written by benchmarks/gpu/run.sh on $(date -u '+%Y-%m-%d %H:%M UTC')," \
       "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)."
  echo
  echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null \
    || echo "nvidia-smi unavailable"
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__)" 2>&1
  echo '```'
  echo
  echo "## Stages"
  echo
  echo '```'
  cat "$WORK/summary.txt" 2>/dev/null
  [ -f "$WORK/tests.log" ] && grep -E "passed|failed|error" "$WORK/tests.log" | tail -3
  echo '```'
  echo
  for part in attention e2e e2e-int8; do
    [ -f "$WORK/$part.md" ] && cat "$WORK/$part.md" && echo
  done
} > "$RESULTS/gpu.md"

echo "=== wrote $RESULTS/gpu.md"
cat "$RESULTS/gpu.md"
if [ -n "${OUT:-}" ]; then
  cp "$RESULTS/gpu.md" "$OUT/" 2>/dev/null
  for log in "$WORK"/*.log "$WORK"/e2e-profile.txt; do [ -f "$log" ] && cp "$log" "$OUT/"; done
fi
exit "$STATUS"
