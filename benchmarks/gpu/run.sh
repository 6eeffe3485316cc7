#!/usr/bin/env bash
# The one command for a lent GPU machine (issue 70), run from the repository root:
#     bash benchmarks/gpu/run.sh [OUT]          (OUT defaults to $OUT/gpu, else gpu-report)
# 1. installs the wheels gathered here by `python -m benchmarks.gpu.wheels` (.gpu-wheels/, carried with the
#    working tree) into .gpu-site/, offline; 2. builds the C selection kernel in place where a C compiler is
#    there (else the NumPy host path runs; the report says which); 3. runs the check under a time limit
#    that leaves the report written (the check skips parts not begun within its own budget).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-${OUT:+$OUT/gpu}}"
out="${out:-gpu-report}"
py="${PYTHON:-python3}"
mkdir -p "$out"
{
  echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC') $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  "$py" -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)"
} 2>&1 | tee "$out/environment.txt"
if ls .gpu-wheels/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --target .gpu-site .gpu-wheels/*.whl 2>&1 | tail -3
  export PYTHONPATH="$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
suffix=$("$py" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
if command -v cc >/dev/null 2>&1 && [ ! -e "baselines/_stare_select$suffix" ]; then
  inc=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
  cc -O3 -shared -fPIC -I"$inc" baselines/_stare_select.c -o "baselines/_stare_select$suffix" 2>&1 | tail -3 \
    || echo "C kernel not built: the NumPy host path runs"
fi
timeout -k 20 "${CHECK_TIMEOUT_S:-540}" "$py" -m benchmarks.gpu.check --device "${DEVICE:-cuda}" --out "$out" \
  --budget-s "${CHECK_BUDGET_S:-450}" ${QUICK:+--quick} 2>&1 | tee "$out/check.log" | grep -v 'Loading weights'
rc=${PIPESTATUS[0]}
echo "check exit status $rc; report: $out/report.md"
exit "$rc"
