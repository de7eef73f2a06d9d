#!/usr/bin/env bash
# One-GPU check for an H200: install, run the tests that exercise CUDA, then time a training step of
# a 1.1B-parameter model in bf16 against transformers' NemotronH and print MFU. Each stage has a
# time limit, and the limits add up to 8 minutes.
#
#   bash benchmarks/gpu_check.sh            # from the repository root
#
# Environment:
#   MAMBA_WHEELS=DIR  install mamba-ssm and causal-conv1d from prebuilt wheels in DIR (their PyPI
#                     releases are source-only and compile for a long time, so they are never built
#                     here); without it the check still runs, on the plain PyTorch scan.
#   SKIP_INSTALL=1    use the current environment as it is.
#   SEQ_LEN, BATCH    shape of the timed steps (default 2048 x 4).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
start=$SECONDS
status=0
step() { printf '\n== %s (%ds)\n' "$1" "$((SECONDS - start))"; }

step "environment"
python - <<'PY' || { echo "no usable torch with CUDA"; exit 1; }
import torch
assert torch.cuda.is_available(), "CUDA is not available"
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
PY

if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
    step "install"
    # Offline machines keep what is installed; the check says so and goes on.
    timeout 90 pip install -q -e '.[dev]' || echo "pip install -e '.[dev]' failed; using the installed packages"
    if [[ -n "${MAMBA_WHEELS:-}" ]]; then
        timeout 60 pip install -q --no-index --find-links "$MAMBA_WHEELS" mamba-ssm causal-conv1d \
            || echo "no mamba-ssm wheel in $MAMBA_WHEELS for this torch/CUDA/python; using the plain scan"
    fi
fi
python - <<'PY'
from nemotron_recipe.models.nemotron_v3 import kernels
print("mamba_ssm SSD kernels:", "used" if kernels.triton_scan_available() else "not installed (PyTorch scan)")
print("causal_conv1d kernel:", "used" if kernels._cuda_conv() is not None else "not installed (PyTorch conv)")
PY

step "tests (CUDA-marked and model parity)"
timeout 150 python -m pytest -q -x tests/test_perf.py tests/test_model.py || status=1

step "throughput: gpu_1b, bf16"
timeout 180 python -m benchmarks.throughput --preset gpu_1b --dtype bf16 --device cuda \
    --batch "${BATCH:-4}" --seq-len "${SEQ_LEN:-2048}" --warmup 2 --steps 5 || status=1

step "done, status $status"
exit "$status"
