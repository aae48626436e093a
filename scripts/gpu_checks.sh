#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go, each stage's output kept in $OUT/<stage>.log:
#
#   bash scripts/gpu_checks.sh                  # every stage (on one H200 with the default
#                                                 BENCH_REPS=3, over 10 minutes by the stage times
#                                                 in bench/results/h200-2026-11-26/)
#   bash scripts/gpu_checks.sh env tests oom    # some of them
#   OUT=/tmp/gpu PYTHON=python3 bash scripts/gpu_checks.sh bench
#
#   env      GPU, driver, gcc, torch and CUDA versions
#   tests    tests/test_cuda.py but its out-of-memory test: NVML reads the run's own GPU; bf16/fp16
#            + fused AdamW repeat and resume bit-identically, one host sync per steady-state step
#            (set_sync_debug_mode), FlexAttention (model.attention=flex) gives SDPA's gradients and
#            resumes bit-identically, torchrun with one GPU over nccl == plain python, FSDP with CPU
#            offload and mixed precision (4 pytest workers where pytest-xdist is installed)
#   oom      a real out-of-memory recovered by splitting, and data.batch_size=auto's fit (alone:
#            they fill the GPU's memory)
#   verify   make verify's audits on the GPU, bf16 and fp16
#   bench    GPT-2 124M: scaffold vs bare loop (tokens/s ratio, MFU, peak memory, data wait), with
#            activation checkpointing as a third arm: 3 arms x BENCH_REPS fresh processes, each
#            compiling the model (start with BENCH_REPS=1 inside a 10-minute device call);
#            BENCH_OVERRIDES="key=value ..." go to every arm (settings to try before the config has them)
#   attention  each attention kernel at GPT-2 124M's shape, deterministic flag off and on: time, and
#            whether its backward repeats bit for bit (bench/attention.py)
#   determinism  GPT-2 124M: scaffold vs bare loop, run.deterministic=true as an arm with SDPA and
#            one with FlexAttention (model.attention=flex)
#   levers   GPT-2 124M: scaffold vs bare loop, each speed setting an arm of its own: flash's
#            attention first (torch's own order on Hopper puts cuDNN's first), micro-batches of 32
#            and 16 instead of the config's 64 (the whole global batch at once), and
#            data.batch_size=auto (which size it picks is in levers.log)
#   chunked_loss  GPT-2 124M: scaffold vs bare loop, the LM head + loss in 4 chunks of 16,384 tokens
#            and in 16 of 4,096 (needs torch's F.linear_cross_entropy: 2.13)
#   compile_modes  GPT-2 124M: scaffold vs bare loop, each torch.compile mode an arm of its own
#   inductor GPT-2 124M: scaffold vs bare loop, inductor's own options as arms
#            (train.compile_options): Triton kernels tuned by coordinate descent (the loss's
#            forward read the logits at 1.4 TB/s on an H200), matmuls autotuned without the
#            pointwise kernels' autotuning, and the loss's softmax in two passes instead of one
#   profile  GPT-2 124M: where the GPU's time goes (train.profile=true), the config as it is
#            (profile_config.log) and in micro-batches of 16 (profile_micro16.log)
#   stall    GPT-2 124M: the checkpoint stall, synchronous vs async
#
# Uses the interpreter in $PYTHON (default python3: a GPU image with torch already in it).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-runs/gpu_checks}
BENCH_STEPS=${BENCH_STEPS:-50}
BENCH_REPS=${BENCH_REPS:-3}
BENCH_OVERRIDES=${BENCH_OVERRIDES:-}
if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "no CUDA GPU visible to $PYTHON: nothing here can be checked" >&2; exit 2
fi
mkdir -p "$OUT"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env tests oom verify bench stall)
xdist=$("$PYTHON" -c 'import xdist' 2>/dev/null && echo "-n 4")
failed=()

stage() {  # name, command...: run it, keep its output, remember a failure and go on
    local name=$1; shift
    echo "=== $name: $*" | tee "$OUT/$name.log"
    local t0=$SECONDS
    "$@" 2>&1 | tee -a "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

for s in "${stages[@]}"; do
    case $s in
    env)
        # gcc: train.compile (the bench's GPT-2 config) needs a C compiler for Triton's launchers
        stage env bash -c "nvidia-smi; { command -v gcc >/dev/null && gcc --version | head -1; } || echo 'no gcc: train.compile=true will fail'; $PYTHON -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name())'" ;;
    tests)
        # -vv: pyproject's -q takes one -v, and each test's name as it ends shows which one a time
        # limit stopped; --durations: which ones take the stage's time
        stage tests "$PYTHON" -m pytest tests/test_cuda.py -vv -rsP --durations=0 -k "not out_of_memory" $xdist ;;
    oom)
        stage oom "$PYTHON" -m pytest tests/test_cuda.py -vv -s -rs -k out_of_memory ;;
    verify)
        # The audit runs stay out of $OUT (kept on failure: many files); the logs name them.
        stage verify_bf16 "$PYTHON" -m tools.verify --out runs/verify_bf16 train.device=cuda train.precision=bf16
        stage verify_fp16 "$PYTHON" -m tools.verify --out runs/verify_fp16 train.device=cuda train.precision=fp16 ;;
    bench)
        # shellcheck disable=SC2086  # the overrides split at spaces, as make bench's
        stage bench "$PYTHON" -m bench.loop_vs_bare --config configs/gpt2_124m.yaml --steps "$BENCH_STEPS" \
            --reps "$BENCH_REPS" --variant model.activation_checkpointing=true $BENCH_OVERRIDES
        cp bench/results/*.jsonl "$OUT/" ;;
    attention)
        stage attention "$PYTHON" -m bench.attention
        cp bench/results/*.jsonl "$OUT/" ;;
    determinism)
        stage determinism "$PYTHON" -m bench.loop_vs_bare --config configs/gpt2_124m.yaml --steps "$BENCH_STEPS" \
            --reps "$BENCH_REPS" --variant run.deterministic=true \
            --variant "run.deterministic=true model.attention=flex"
        cp bench/results/*.jsonl "$OUT/" ;;
    levers)
        stage levers "$PYTHON" -m bench.loop_vs_bare --config configs/gpt2_124m.yaml --steps "$BENCH_STEPS" \
            --reps "$BENCH_REPS" --variant train.attention_kernel=flash --variant data.batch_size=32 \
            --variant data.batch_size=16 --variant data.batch_size=auto
        cp bench/results/*.jsonl "$OUT/" ;;
    chunked_loss)
        # Checked first: the bench builds a variant's model after the scaffold and bare arms ran.
        if ! "$PYTHON" -c 'import sys, torch.nn.functional as F; sys.exit(not hasattr(F, "linear_cross_entropy"))'; then
            echo "=== chunked_loss: skipped: this torch has no F.linear_cross_entropy (2.13 has it)"
            continue
        fi
        stage chunked_loss "$PYTHON" -m bench.loop_vs_bare --config configs/gpt2_124m.yaml --steps "$BENCH_STEPS" \
            --reps "$BENCH_REPS" --variant model.loss_chunks=4 --variant model.loss_chunks=16
        cp bench/results/*.jsonl "$OUT/" ;;
    compile_modes)
        stage compile_modes "$PYTHON" -m bench.loop_vs_bare --config configs/gpt2_124m.yaml --steps "$BENCH_STEPS" \
            --reps "$BENCH_REPS" --variant train.compile_mode=max-autotune-no-cudagraphs \
            --variant train.compile_mode=reduce-overhead
        cp bench/results/*.jsonl "$OUT/" ;;
    inductor)
        stage inductor "$PYTHON" -m bench.loop_vs_bare --config configs/gpt2_124m.yaml --steps "$BENCH_STEPS" \
            --reps "$BENCH_REPS" --variant train.compile_options.coordinate_descent_tuning=true \
            --variant train.compile_options.max_autotune_gemm=true --variant train.compile_options.online_softmax=false
        cp bench/results/*.jsonl "$OUT/" ;;
    profile)
        for name in config micro16; do
            rm -rf "runs/profile_$name"
            more=(); [ "$name" = micro16 ] && more=(data.batch_size=16)
            stage "profile_$name" "$PYTHON" train.py --config configs/gpt2_124m.yaml "run.out_dir=runs/profile_$name" \
                train.max_steps=8 train.profile=true train.eval_every=0 train.ckpt_every=0 "${more[@]}"
        done ;;
    stall)
        stage ckpt_stall "$PYTHON" -m bench.ckpt_stall --config configs/gpt2_124m.yaml --reps "$BENCH_REPS"
        cp bench/results/*.jsonl "$OUT/" ;;
    *)
        echo "unknown stage $s; expected env, tests, oom, verify, bench, attention, determinism, levers," \
             "chunked_loss, compile_modes, inductor, profile or stall" >&2
        exit 2 ;;
    esac
done
[ ${#failed[@]} -eq 0 ] && echo "all stages passed" || { echo "failed: ${failed[*]}"; exit 1; }
