#!/usr/bin/env bash
# One lent-GPU session in one command (the device machines have PyTorch with
# CUDA but no network and no Rust). Here: `make wheel`; then run, with `dist`
# carried: `bash benches/on_device.sh`. Logs and the bench's JSON go to $OUT.
#   1. install the carried wheel into /tmp/site;
#   2. the cuda-marked tests (`make test-cuda`);
#   3. FIRST_TESTS, if given (e.g. a test that failed there, with tracebacks);
#   4. the GPU benchmark (`make bench-gpu`; BENCH_ARGS, e.g. --quick);
#   5. as much of the pytest suite as the time left allows (SUITE_FILES;
#      NO_SUITE=1 skips it).
set -u
OUT=${OUT:-/tmp/hs-device-out}
mkdir -p "$OUT"
deadline=$(($(date +%s) + ${BUDGET_S:-540}))
left() { echo $((deadline - $(date +%s))); }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site dist/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import sys, torch, hindsight; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(), hindsight.__file__)'
    nproc
    df -h . /tmp | tail -2
} 2>&1 | tee "$OUT/env.txt"

echo "== test-cuda ($(left) s left)"
(cd tests && timeout "${CUDA_S:-150}" python3 -m pytest -q -m cuda -p no:cacheprovider) >"$OUT/test-cuda.log" 2>&1
echo "test-cuda exit $?"
tail -25 "$OUT/test-cuda.log"

if [ -n "${FIRST_TESTS:-}" ]; then
    echo "== first: $FIRST_TESTS ($(left) s left)"
    # shellcheck disable=SC2086
    (cd tests && timeout "${FIRST_S:-90}" python3 -m pytest -x -q --tb=short -p no:cacheprovider $FIRST_TESTS) >"$OUT/first.log" 2>&1
    echo "first exit $?"
    tail -60 "$OUT/first.log"
fi

echo "== bench-gpu ($(left) s left)"
# SIGINT, not SIGTERM: the bench still prints the table of what it measured.
# shellcheck disable=SC2086
timeout -s INT "${BENCH_S:-330}" python3 benches/bench_gpu.py ${BENCH_ARGS:-} --json "$OUT/bench.json" >"$OUT/bench.log" 2>&1
echo "bench-gpu exit $?"
tail -40 "$OUT/bench.log"

t=$(left)
echo "== suite ($t s left)"
if [ "$t" -gt 30 ] && [ -z "${NO_SUITE:-}" ]; then
    # shellcheck disable=SC2086
    (cd tests && timeout "$t" python3 -m pytest -v -p no:cacheprovider ${SUITE_FILES:-test_roundtrip.py test_unchanged.py test_dedup.py test_gil.py test_background.py test_integrity.py test_lightning.py}) >"$OUT/suite.log" 2>&1
    echo "suite exit $?"
    grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/suite.log" | awk '{print $2}' | sort | uniq -c
    grep -E "FAILED|ERROR" "$OUT/suite.log" | head -20
    tail -5 "$OUT/suite.log"
fi
