#!/usr/bin/env bash
# The torch paths on a lent GPU machine (docs/performance.md, "On a GPU").
#
# Those machines run Python 3.12 with a CUDA build of torch, where onnxruntime-training 1.19.2
# cannot be installed: backend=torch and backend=compile (torch.compile) are tried, on the CPU and on
# CUDA in fp32 (TF32 matrix products on, the default, and off), fp16 and bf16; compile's compile
# time is its own column (the step time leaves it out).
# Hydra, MLflow and the rest of the pure-Python stack travel as wheels in .whl/ (fetched here with
# ../shared/gpu/fetch-wheels.sh); they go into a temporary folder, not into the machine's Python.
#
# Then benchmarks/gpu_loop.py: orchestrate's loop against a fast hand-written one (fp32 with TF32 off
# and on, bf16, fp16; the shipped 2-layer GPT at batch 64 and a 6-layer one at batch 256), after
# checking that no step between reading steps synchronizes with the host
# (torch.cuda.set_sync_debug_mode("error")); the check's failure is this script's exit code.
#
# Usage, from the project root on the GPU machine:  bash scripts/gpu_check.sh [max_steps] [runs|loop|all]
# Prints one table row per run; copies the runs' MLflow store and the log to $OUT when set.
set -u
steps=${1:-500}
parts=${2:-all}
site=$(mktemp -d); work=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl || exit 1
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
python3 - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}, {torch.get_num_threads()} CPU threads")
EOF
python3 -c "import sklearn" 2>/dev/null && mlp="model=mlp data=digits" || mlp="model=mlp data=synthetic"
gpt="model=char_transformer data=python_source"
rc=0
if [ "$parts" != loop ]; then
echo "| model | backend | device | precision | steps | wall s | samples/s | compile s | final train loss | eval loss |"
echo "|---|---|---|---|---:|---:|---:|---:|---:|---:|"
i=0
for backend in torch compile; do
for model in "$mlp" "$gpt"; do
  for run in "trainer.device=cpu" "trainer.device=cuda trainer.tf32=false" "trainer.device=cuda" \
             "trainer.device=cuda trainer.precision=fp16" "trainer.device=cuda trainer.precision=bf16"; do
    i=$((i + 1)); log="$work/run$i.log"
    python3 -m orchestrate backend=$backend $model $run trainer.max_steps="$steps" \
      tracking.uri="sqlite:///$work/gpu.db" hydra.run.dir="$work/out$i" > "$log" 2>&1
    rc=$?
    cat "$log" >> "$work/all.log"
    get() { tr '\r' '\n' < "$log" | grep -E "^  $1 " | awk '{print $NF}' | tail -1; }
    compile_s=$(tr '\r' '\n' < "$log" | grep -E "^  compile \(s\) " | awk '{print $3}' | tail -1)
    wall=$(tr '\r' '\n' < "$log" | grep -Eo "steps in [0-9.]+ s" | awk '{print $3}')
    prec=$(echo "$run" | grep -Eo 'fp16|bf16' || echo fp32)
    echo "$run" | grep -q 'device=cuda' && [ "$prec" = fp32 ] && prec="fp32, tf32=$(echo "$run" | grep -q tf32=false && echo off || echo on)"
    dev=$(echo "$run" | grep -q cuda && echo cuda || echo cpu)
    if [ $rc -ne 0 ]; then
      echo "| ${model%% *} | $backend | $dev | $prec | $steps | failed (exit $rc): $(grep -m1 -E 'Error|error' "$log") | | | | |"
    else
      echo "| ${model%% *} (${model##* }) | $backend | $dev | $prec | $steps | $wall | $(get samples/s) | ${compile_s:--} | $(get 'final train loss') | $(get 'eval loss') |"
    fi
  done
done
done
fi
if [ "$parts" != runs ]; then
  echo
  python3 benchmarks/gpu_loop.py --check-syncs --repeats 1 2> "$work/gpu_loop.log" || rc=1
  [ -n "${OUT:-}" ] && cp "$work/gpu_loop.log" "$OUT/"
fi
if [ -n "${OUT:-}" ]; then cp "$work/gpu.db" "$work/all.log" "$OUT/" 2>/dev/null; fi
exit $rc
