"""Same numbers: short runs reproduce the per-step metrics of a baseline commit (relative
difference under 1e-6), on every CPU.

The cases are ``rlpost train [RECIPE] sft.steps=200 train.steps=5 eval.limit=50
eval.samples=1`` for the default recipe (grpo), ppo_arith (critic), dapo_arith
(dynamic sampling) and the default recipe with partial rollout and length-aware
batching. Float rounding differs between CPUs (AMX, AVX-512 BF16 or neither, and
their kernels, some picked at run time), and 200 warm-up steps carry a one-ulp
difference into visibly different numbers. No digest of a small pass tells two CPUs
apart reliably (a fingerprint once matched on CPUs whose runs differed), so the
reference is always the baseline commit's own code (``git archive`` of it, run in a
subprocess) on this machine. Its numbers are cached per machine, keyed by the
baseline, torch's version and build, the CPU's model and flags and the thread count,
so a machine pays for the baseline run once. ``golden_metrics.json`` names the
baseline commit.

After a deliberate numerical change, commit it, then run this file as a script: it
moves the baseline to HEAD. Say why in the commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlpost.config import RECIPES_DIR, load_config
from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
from rlpost.pipeline.loop import train

GOLDEN_FILE = Path(__file__).parent / "golden_metrics.json"
GOLDEN = json.loads(GOLDEN_FILE.read_text())
REPO = Path(__file__).resolve().parents[2]
CASES = {
    "grpo": ("grpo_arith.yaml", []),
    "ppo": ("ppo_arith.yaml", []),
    "dapo": ("dapo_arith.yaml", []),
    "partial": ("grpo_arith.yaml", ["rollout.partial=true", "rollout.length_aware=true"]),
}
COMMON = [
    "sft.steps=200",
    "train.steps=5",
    "eval.limit=50",
    "eval.samples=1",
    "observe.progress=false",
    "observe.plot=false",
]
# A case records those its rows have (PPO's critic warm-up steps have no pg_loss).
STEP_KEYS = [
    "loss", "pg_loss", "reward_mean", "kl", "grad_norm", "clip_frac", "logprob_gap",
    "response_length_mean", "vf_loss",
]  # fmt: skip
SUMMARY_KEYS = ["eval_accuracy_start", "eval_accuracy_end"]

# Runs the cases with whichever rlpost is first on sys.path (the baseline's tree, when
# the test runs it): only load_config and train, whose signatures every commit keeps.
DRIVER = """
import json, sys
from rlpost.config import RECIPES_DIR, load_config
from rlpost.pipeline.loop import train
spec = json.loads(open(sys.argv[1]).read())
out = {}
for case, (recipe, extra) in spec["cases"].items():
    over = [*spec["common"], f"run.output_dir={spec['dir']}/{case}", *extra]
    result = train(load_config(RECIPES_DIR / recipe, over))
    keys = [k for k in spec["step_keys"] if all(k in row for row in result.history)]
    out[case] = [{k: row[k] for k in keys} for row in result.history]
    out[case + "_summary"] = {k: result.summary[k] for k in spec["summary_keys"]}
open(sys.argv[2], "w").write(json.dumps(out))
"""


def numeric_fingerprint() -> str:
    """Digest of a fixed forward and backward pass of the tiny model (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = build_char_tokenizer()
        model = build_tiny_model(tok, seed=0)
        ids = torch.arange(3, 35).reshape(2, 16) % model.config.vocab_size
        logits = model(input_ids=ids).logits
        logits.logsumexp(-1).sum().backward()
        grad = next(model.parameters()).grad
        data = logits.detach().numpy().tobytes() + grad.numpy().tobytes()
    finally:
        torch.set_num_threads(threads)
    return hashlib.sha256(data).hexdigest()[:16]


def machine_key(baseline: str) -> str:
    """What the baseline's numbers depend on besides its code: torch, the CPU, the threads."""
    cpu = ""
    if Path("/proc/cpuinfo").is_file():
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    parts = [
        baseline, torch.__version__, torch.__config__.show(), platform.machine(), cpu,
        str(os.cpu_count()), str(torch.get_num_threads()), numeric_fingerprint(),
    ]  # fmt: skip
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rlpost" / "golden"


def run_case(case: str, out: Path):
    recipe, extra = CASES[case]
    cfg = load_config(RECIPES_DIR / recipe, [*COMMON, f"run.output_dir={out}", *extra])
    return train(cfg)


def run_commit(commit: str, work: Path) -> dict:
    """Every case's numbers as the code of ``commit`` computes them on this CPU."""
    try:
        subprocess.run(
            ["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"],
            check=True, capture_output=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.fail(
            f"no recording for this CPU and no baseline commit {commit[:12]} in {REPO} to run; "
            "run tests/integration/test_golden_metrics.py as a script in a full clone"
        )
    tree = work / "baseline"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "rlpost"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    spec = {
        "cases": CASES, "common": COMMON, "dir": str(work / "runs"),
        "step_keys": STEP_KEYS, "summary_keys": SUMMARY_KEYS,
    }  # fmt: skip
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(work / "spec.json"), str(work / "out.json")],
        cwd=tree, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, f"baseline {commit[:12]} failed:\n{proc.stderr[-3000:]}"
    return json.loads((work / "out.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The baseline commit's numbers on this machine: from the cache, or run now and cached."""
    baseline = GOLDEN["baseline"]
    cached = cache_dir() / f"{machine_key(baseline)}.json"
    if cached.is_file():
        try:
            return json.loads(cached.read_text())
        except ValueError:
            pass  # a torn cache entry is run again and replaced
    numbers = run_commit(baseline, tmp_path_factory.mktemp("golden"))
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(numbers))
    tmp.replace(cached)
    return numbers


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_numbers_as_baseline(case, reference, tmp_path):
    result = run_case(case, tmp_path)
    assert len(result.history) == len(reference[case])
    for got, want in zip(result.history, reference[case], strict=True):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-12), (case, got["step"], key)
    for key, value in reference[f"{case}_summary"].items():
        assert result.summary[key] == value


def test_baseline_is_a_commit_of_this_history():
    """The reference is a commit every clone has, so no CPU compares against less."""
    assert set(GOLDEN) == {"baseline"} and len(GOLDEN["baseline"]) == 40
    proc = subprocess.run(
        ["git", "-C", str(REPO), "merge-base", "--is-ancestor", GOLDEN["baseline"], "HEAD"],
        capture_output=True,
    )  # fmt: skip
    if proc.returncode == 128 and not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    assert proc.returncode == 0, f"baseline {GOLDEN['baseline'][:12]} is not an ancestor of HEAD"


if __name__ == "__main__":  # after a deliberate numerical change (committed): rebase
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    GOLDEN_FILE.write_text(json.dumps({"baseline": head}, indent=1) + "\n")
    print(f"baseline {head[:12]}; each machine runs it once into {cache_dir()}")
