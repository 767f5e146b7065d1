#!/usr/bin/env bash
# GPU check of run.device=cuda, offline (no pip, no network). Usage: bench/gpu_check.sh [OUT_DIR]
#  1. nvidia-smi and what torch sees
#  2. the CUDA tests (tests/integration/test_cuda.py)
#  3. STEPS GRPO steps of the default recipe on the GPU (local backend): held-out accuracy
#  4. the same with two rollout worker processes and the trainer process on the one GPU
#  5. rlpost tinker --device cuda on SmolLM2-135M-Instruct (MODEL, default tests/real_model.py's):
#     a short SDK loop (sample, forward_backward, optim_step), seconds per step and the loss
#  6. the wall time of each part
# SFT_STEPS (default 500) shortens the SFT warm-up of 3 and 4 (the recipe's is 2500);
# STEPS (default 20) sets their GRPO steps (the recipe's is 300).
set -u
OUT_DIR=${1:-/tmp/gpu_check}
SFT_STEPS=${SFT_STEPS:-500}
STEPS=${STEPS:-20}
PY=${PYTHON:-python}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT_DIR"
STAMP=$(date +%Y%m%d-%H%M%S)

# rlpost's runtime dependencies (pyproject.toml): each installed, in the range it names
if ! "$PY" - <<'PY'; then
import re, sys, tomllib
from importlib.metadata import PackageNotFoundError, version

try:
    from packaging.requirements import Requirement
except ImportError:  # without packaging: presence only
    Requirement = None
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
problems = []
for dep in deps:
    name = re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0]
    try:
        have = version(name)
    except PackageNotFoundError:
        problems.append(f"{name} (missing)")
        continue
    if Requirement is not None and not Requirement(dep).specifier.contains(have, prereleases=True):
        problems.append(f"{name} {have} (needs {dep})")
if problems:
    print("gpu_check: rlpost's dependencies are not met: " + ", ".join(problems), file=sys.stderr)
    sys.exit(1)
PY
    exit 2
fi

declare -A WALL
timed() {  # timed NAME CMD...: run CMD, record its wall seconds under NAME
    local name=$1 t0 rc
    shift
    t0=$EPOCHREALTIME
    "$@"
    rc=$?
    WALL[$name]=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    echo "== $name: rc=$rc, ${WALL[$name]} s"
    return $rc
}

accuracy() {  # accuracy SUMMARY_JSON
    "$PY" - "$1" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"  held-out accuracy {s['eval_accuracy_start']} -> {s['eval_accuracy_end']}"
      f" (greedy {s['eval_greedy_accuracy_start']} -> {s['eval_greedy_accuracy_end']}),"
      f" reward {s['reward_mean_first']} -> {s['reward_mean_last']}, wall {s['wall_seconds']:.1f} s")
PY
}

echo "== 1. device"
nvidia-smi || echo "nvidia-smi not found"
"$PY" - <<'PY'
import torch, transformers
print(f"torch {torch.__version__} (cuda {torch.version.cuda}), transformers {transformers.__version__}")
print(f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB, bf16: {torch.cuda.is_bf16_supported()}")
PY

echo "== 2. CUDA tests"
if "$PY" -c "import pytest" 2>/dev/null; then
    timed tests "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_cuda.py
else
    echo "pytest is not installed: CUDA tests skipped"
fi

COMMON=("train.steps=$STEPS" observe.progress=false observe.plot=false "sft.steps=$SFT_STEPS")

echo "== 3. GRPO on cuda, local backend"
timed grpo_local "$PY" -m rlpost.cli train run.device=cuda "${COMMON[@]}" \
    "run.output_dir=$OUT_DIR/gpu_grpo" "run.name=local-$STAMP" \
    && accuracy "$OUT_DIR/gpu_grpo/local-$STAMP/summary.json"

echo "== 4. GRPO on cuda, process backend, 2 rollout workers + trainer on one GPU"
timed grpo_process "$PY" -m rlpost.cli train run.device=cuda "${COMMON[@]}" \
    cluster.backend=process cluster.rollout_workers=2 \
    "run.output_dir=$OUT_DIR/gpu_grpo" "run.name=process-$STAMP" \
    && accuracy "$OUT_DIR/gpu_grpo/process-$STAMP/summary.json"

echo "== 5. rlpost tinker on cuda: an SDK loop (bench/bench_tinker_clients.py)"
MODEL=${MODEL:-$("$PY" -c "from tests.real_model import smollm2_dir; print(smollm2_dir())" 2>/dev/null)}
if "$PY" -c "import tinker" 2>/dev/null && [ -f "$MODEL/config.json" ]; then
    timed tinker "$PY" bench/bench_tinker_clients.py --model "$MODEL" --device cuda \
        --clients 1 --steps 4 --samples 8 --max-tokens 32
else
    echo "the tinker SDK or $MODEL is missing: rlpost tinker skipped"
fi

echo "== 6. wall seconds"
for k in tests grpo_local grpo_process tinker; do
    printf "  %-14s %s\n" "$k" "${WALL[$k]:-not run}"
done
