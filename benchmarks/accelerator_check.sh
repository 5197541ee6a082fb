#!/usr/bin/env bash
# Accelerator check: model FLOPs utilisation and peak memory of a FoT training step in bf16
# (a 184M and a 1B-class model, analysis plans d = 1, 8, 64) on this machine's first device.
# Each configuration runs in its own process (its own peak-memory counter; a failure such as
# out-of-memory is written down and the others still run); then the table is printed.
#
#   benchmarks/accelerator_check.sh                  # GPU / TPU host, as is
#   benchmarks/accelerator_check.sh --reduced        # CPU smoke form (2-layer tiny model, d = 2), seconds
#
# Environment: PYTHON (default python), OUT (result folder, default accelerator_check_out),
# SIZES (default "184m 1b"), DS (default "1 8 64"), IMPLS (default "blockwise"; add "fused" on a
# GPU to try the cuDNN kernel for layers without extra contexts), EXTRA (more flags for every run,
# e.g. "--slots 32" where a device has less memory).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-accelerator_check_out}
SIZES=${SIZES:-"184m 1b"}
DS=${DS:-"1 8 64"}
IMPLS=${IMPLS:-"blockwise"}
EXTRA=${EXTRA:-}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
mkdir -p "$OUT"
rm -f "$OUT"/*.json
failed=0
if [[ "${1:-}" == "--reduced" ]]; then  # one process, one small plan: kept green by tests/test_benchmarks.py
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"  # half the compile time; times mean nothing here
  # shellcheck disable=SC2086
  "$PYTHON" -m benchmarks.accelerator_check --reduced --d 2 --impl dense $EXTRA --out "$OUT" || failed=1
else
  "$PYTHON" -c "import jax; print('jax', jax.__version__, jax.default_backend(), jax.devices()[0].device_kind)"
  for size in $SIZES; do
    for impl in $IMPLS; do
      for d in $DS; do
        echo "== $size d=$d $impl"
        # shellcheck disable=SC2086
        "$PYTHON" -m benchmarks.accelerator_check --size "$size" --d "$d" --impl "$impl" $EXTRA --out "$OUT" \
          || failed=$((failed + 1))
      done
    done
  done
fi
echo
"$PYTHON" -m benchmarks.accelerator_check --summarize "$OUT"
echo "results: $OUT/ ($failed failed)"
exit $((failed > 0))
