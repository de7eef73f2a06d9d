#!/usr/bin/env bash
# One-GPU check for an H200 image with torch (CUDA), transformers and peft but none of hydra-core,
# omegaconf or pytest, and no network: install the missing pure-Python wheels and the
# project without touching the image's torch, run the tests that exercise CUDA (cached decoding against
# full recompute among them), time a training step of a 1.1B-parameter model in bf16 against
# transformers' NemotronH, then greedy decoding of the h1024 model in bf16 against transformers'
# `generate`, and print one summary block. Each stage has a time limit; the limits add up to 470 s,
# inside 8 minutes.
#
#   bash benchmarks/gpu_check.sh --download   # first, on a machine with network: fills $WHEELS
#   bash benchmarks/gpu_check.sh --dry-run    # what it would install and run here, nothing done
#   bash benchmarks/gpu_check.sh              # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --pytorch-path   # instead of the tests and the comparison with
#                     transformers: the PyTorch scan and conv against mamba_ssm's and causal_conv1d's
#                     kernels (training step of gpu_1b, and the scan alone eager and compiled;
#                     benchmarks/pytorch_path.py), in its own 400 s
#
# --download runs `pip download --only-binary=:all: --python-version 3.12 --no-deps` for the wheels
# listed in WHEEL_PINS (the versions the CPU install is tested with) and builds antlr4's, which PyPI
# has as a source archive only, into a pure-Python wheel. Copy the folder along with the repository:
# all that travels to a lent GPU machine is limited to 64 MiB, so the wheels stay small (under 1 MiB
# but pygments' 1.2 MiB). `datasets` (with pyarrow's 55 MB and pandas' 12 MB) is not among them: the
# check reads no Parquet, CSV or hub data (tests/test_gpu_ready.py holds the list to 20 MiB).
#
# Environment:
#   WHEELS=DIR        the downloaded wheels (default: wheels/ in the repository, ignored by git).
#   MAMBA_WHEELS=DIR  prebuilt mamba-ssm and causal-conv1d wheels for the image's torch/CUDA/python,
#                     installed with --no-deps (mamba-ssm asks for tilelang and quack-kernels, which
#                     the kernels used here do not need); without them the PyTorch paths run.
#   SKIP_INSTALL=1    use the current environment as it is.
#   PYTHON            the interpreter (default python3).
#   SEQ_LEN, BATCH    shape of the timed steps (default 2048 x 4).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-wheels}
WHEEL_PINS=(
    hydra-core==1.3.8 omegaconf==2.3.1 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 einops==0.8.2
)
ANTLR_PIN=antlr4-python3-runtime==4.9.3
mode=run
case "${1:-}" in
    "") ;;
    --dry-run) mode=dry ;;
    --download) mode=download ;;
    --pytorch-path) mode=run; pytorch_path=1 ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run | --download | --pytorch-path]"; exit 2 ;;
esac

if [[ $mode == download ]]; then
    mkdir -p "$WHEELS" || exit 1
    "$PYTHON" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --no-deps -d "$WHEELS" "${WHEEL_PINS[@]}" || exit 1
    "$PYTHON" -m pip wheel --no-deps -w "$WHEELS" "$ANTLR_PIN" || exit 1
    ls "$WHEELS"
    exit 0
fi

if [[ $mode == dry ]]; then
    echo "wheels --download fetches: ${WHEEL_PINS[*]} $ANTLR_PIN"
fi

start=$SECONDS
status=0
step() { printf '\n== %s (%ds)\n' "$1" "$((SECONDS - start))"; }
# run LIMIT CMD...: run under a time limit, or print it (shell-quoted) on a dry run.
run() {
    local limit=$1
    shift
    if [[ $mode == dry ]]; then
        printf 'would run (limit %ss):' "$limit"
        printf ' %q' "$@"
        printf '\n'
        return 0
    fi
    timeout "$limit" "$@"
}
# run_logged LOG LIMIT CMD...: `run`, its output also kept in LOG for the summary.
run_logged() {
    local log=$1
    shift
    if [[ $mode == dry ]]; then
        run "$@"
        return 0
    fi
    run "$@" 2>&1 | tee "$log"
    return "${PIPESTATUS[0]}"
}
installed() { "$PYTHON" -c 'import importlib.metadata as m, sys; m.version(sys.argv[1])' "$1" 2>/dev/null; }

if [[ $mode == run ]]; then
    step "environment"
    "$PYTHON" - <<'PY' || { echo "no usable torch with CUDA"; exit 1; }
import torch
assert torch.cuda.is_available(), "CUDA is not available"
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
PY
fi

if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
    step "install"
    if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "no wheels in $WHEELS/: run 'bash benchmarks/gpu_check.sh --download' on a machine with network" \
             "and copy $WHEELS/ here (or set WHEELS=DIR, or SKIP_INSTALL=1 to use this environment as it is)"
        exit 1
    fi
    # Only what the image lacks, without dependencies: an installed package (numpy, the image's
    # torch, ...) is never replaced.
    missing=()
    for wheel in "$WHEELS"/*.whl; do
        name=$(basename "$wheel" | cut -d- -f1)
        if installed "$name"; then
            echo "skip $(basename "$wheel"): $name is installed"
        else
            missing+=("$wheel")
        fi
    done
    if ((${#missing[@]})); then
        run 60 "$PYTHON" -m pip install -q --no-deps --no-index "${missing[@]}" || { echo "wheel install failed"; exit 1; }
    fi
    # The project on the image's torch: no dependency resolution and no build isolation (that would
    # fetch setuptools from the network). Without setuptools it runs from the checkout instead.
    run 30 "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . \
        || { echo "project install failed; running it from the checkout (PYTHONPATH)"; export PYTHONPATH=$PWD; }
    if [[ -n "${MAMBA_WHEELS:-}" ]]; then
        run 30 "$PYTHON" -m pip install -q --no-deps --no-index --find-links "$MAMBA_WHEELS" mamba-ssm causal-conv1d \
            || echo "no mamba-ssm/causal-conv1d wheel in $MAMBA_WHEELS for this torch/CUDA/python; using the PyTorch paths"
    fi
fi

log=$(mktemp -d)
if [[ $mode == run ]]; then
    "$PYTHON" - <<'PY' | tee "$log/kernels"
from nemotron_recipe.models.nemotron_v3 import kernels
print("mamba_ssm SSD kernels:", "used" if kernels.triton_scan_available() else "not usable (PyTorch scan)")
print("causal_conv1d kernel:", "used" if kernels._cuda_conv() is not None else "not usable (PyTorch conv)")
PY
fi

if [[ -n "${pytorch_path:-}" ]]; then
    step "PyTorch path against the kernels: gpu_1b, bf16"
    run_logged "$log/pytorch_path" 400 "$PYTHON" -m benchmarks.pytorch_path --preset gpu_1b --dtype bf16 \
        --batch "${BATCH:-4}" --seq-len "${SEQ_LEN:-2048}" --warmup 2 --steps 5 || status=1
    printf '\n== summary (%ds, status %d)\n' "$((SECONDS - start))" "$status"
    cat "$log/kernels"
    grep -E '^(step |PyTorch path|scan )' "$log/pytorch_path" || echo "pytorch_path: no result (see above)"
    exit "$status"
fi

step "tests (GPU readiness, CUDA-marked, parity with transformers)"
run_logged "$log/tests" 160 "$PYTHON" -m pytest -q tests/test_gpu_ready.py tests/test_perf.py tests/test_model.py \
    tests/test_generation.py -k "gpu_ready or cuda or transformers" || status=1

step "throughput: gpu_1b, bf16"
run_logged "$log/bench" 150 "$PYTHON" -m benchmarks.throughput --preset gpu_1b --dtype bf16 --device cuda \
    --batch "${BATCH:-4}" --seq-len "${SEQ_LEN:-2048}" --warmup 2 --steps 5 || status=1

step "decode: h1024, bf16, batches 1 and 8"
run_logged "$log/decode" 40 "$PYTHON" -m benchmarks.decode --device cuda --dtypes bf16 --new-tokens 64 --rounds 1 \
    --no-record || status=1

if [[ $mode == run ]]; then
    printf '\n== summary (%ds, status %d)\n' "$((SECONDS - start))" "$status"
    "$PYTHON" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))'
    cat "$log/kernels"
    echo "tests: $(grep -E '(passed|failed|error)' "$log/tests" | tail -1)"
    grep -E '^(training step|  ours|theirs|ours/theirs)' "$log/bench" || echo "throughput: no result (see above)"
    grep -E '^\| .* h1024 \| bf16 \|' "$log/decode" || echo "decode: no result (see above)"
fi
exit "$status"
