#!/usr/bin/env bash
# Lent-GPU work by stage, on a machine whose python3 already has torch, Triton, transformers and
# accelerate (the device image) and no network. Arguments after the stage go to the stage's script and
# override its defaults here; each stage is meant to fit one 10-minute call (split with them if not):
#
#   bash benchmarks/gpu_session.sh tests                        # the gpu-marked tests
#   bash benchmarks/gpu_session.sh tune --kernels forward dq    # tune_tiles (default: every kernel)
#   bash benchmarks/gpu_session.sh attention                    # bench_attention at 128K (the targets, the
#                                                               #   Flex check), then 32K; then, in a second
#   bash benchmarks/gpu_session.sh attention --seq_lens 65536 262144   # call, the other lengths
#   bash benchmarks/gpu_session.sh e2e --variants sdpa+liger --max_seq 262144   # bench_e2e, Qwen2.5-0.5B,
#   bash benchmarks/gpu_session.sh e2e --variants sparse_cp                     #   S from 128K
#
# The scripts rewrite their JSON as they go (bench_attention after every S, bench_e2e after every run,
# tune_tiles after every candidate), so a call cut off by its time limit keeps what it measured. (A dense 0.5B step at 256K takes about half a minute on an H100 by the issue's
# own 7.6K tokens/s, so the dense baselines stop at 256K; every e2e run is capped at 5 minutes so that
# a call returns its JSON.)
#
# Wheels of packages the image lacks (liger-kernel for bench_e2e's baseline) are read from .whl/ when
# present. Logs and JSON go to $OUT (the device tool's folder) or, without it, benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
stage="${1:-}"
case "$stage" in
    tests|tune|attention|e2e) shift ;;
    *) echo "usage: gpu_session.sh tests|tune|attention|e2e [arguments for that stage]" >&2; exit 2 ;;
esac
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
python3 -c "import torch, triton; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device',
                                     'torch', torch.__version__, 'triton', triton.__version__)"

case "$stage" in
    tests)
        python3 -m pytest -q -m gpu "$@" tests 2>&1 | tee "$out/gpu-tests.log" ;;
    tune)
        python3 benchmarks/tune_tiles.py --output "$out/tiles.json" "$@" 2>&1 | tee "$out/tune.log" ;;
    attention)
        python3 benchmarks/bench_attention.py --seq_lens 131072 32768 --output "$out/attention.json" "$@" 2>&1 \
            | tee "$out/attention.log" ;;
    e2e)
        python3 benchmarks/bench_e2e.py --models 0.5b --min_seq 131072 --timeout_s 300 --output "$out/e2e.json" "$@" 2>&1 \
            | tee "$out/e2e.log" ;;
esac
