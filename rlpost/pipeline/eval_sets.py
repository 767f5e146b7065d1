"""Evaluation sets (``eval.sets``): each set's held-out problems and its own metrics.

From ``n`` samples per problem come mean@k, pass@k and maj@k (:mod:`rlpost.algos.eval_metrics`),
a sample correct above 0.5; ``greedy`` is one at temperature 0. Keys, owned here:
``eval/<set>/<metric>``, ``eval/<set>/problems`` and ``eval/<set>/reward_mean``.
:func:`held_out_eval` is what a training run and ``rlpost eval`` both run.
"""

from __future__ import annotations

from dataclasses import replace

from rlpost.algos.eval_metrics import parse_metric, problem_metric
from rlpost.config import Config, EvalSetConfig
from rlpost.data.sources import by_source
from rlpost.pipeline import build
from rlpost.pipeline.evaluate import eval_label, evaluate, sample_groups
from rlpost.rewards.answers import answer_extractor
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.types import Group, Prompt

PREFIX = "eval/"


def set_terms(cfg: Config, s: EvalSetConfig):
    """The reward terms that score set ``s`` (and whose extraction its vote reads)."""
    if s.reward is not None:
        return s.reward
    own = {d.name: d.reward for d in cfg.data.sources if d.reward is not None}
    return own.get(s.name, cfg.reward.terms)


def set_metrics(s: EvalSetConfig, groups: list[Group], extract, problems: int) -> dict[str, float]:
    """Metrics of ``s`` over its sampled groups (greedy aside), keyed by metric name; a
    problem whose samples were all dropped (no group) counts as wrong."""
    sampled = [parse_metric(m) for m in s.metrics if m != "greedy"]
    per: dict[str, float] = {f"{kind}@{k}": 0.0 for kind, k in sampled}
    for g in groups:
        correct = [x > 0.5 for x in g.scores]
        answers = [extract(c.episode.answer if c.episode else c.text) for c in g.completions]
        for kind, k in sampled:
            per[f"{kind}@{k}"] += problem_metric(kind, k, correct, answers)
    scores = [x for g in groups for x in g.scores]
    out = {m: v / max(problems, 1) for m, v in per.items()}
    out["reward_mean"] = sum(scores) / len(scores) if scores else 0.0
    return out


def evaluate_sets(
    cfg: Config,
    rollout,
    reward,
    prompts: list[Prompt],
    sampled: SamplingParams,
    greedy: SamplingParams | None,
    progress=None,
) -> dict[str, float]:
    """``eval/<set>/<metric>`` of every set; ``greedy=None`` leaves the greedy metric out."""
    rows = by_source(prompts)
    out: dict[str, float] = {}
    for i, s in enumerate(cfg.eval.sets):
        part = rows.get(s.name, [])
        if not part:
            continue
        key = f"{PREFIX}{s.name}/"
        values: dict[str, float] = {"problems": float(len(part))}
        if any(m != "greedy" for m in s.metrics):
            # Each set its own seeds, so two sets of one task do not share samples.
            params = replace(
                sampled, seed=None if sampled.seed is None else sampled.seed + i * 7919
            )
            groups = sample_groups(rollout, reward, part, params, s.n, progress=progress)
            values |= set_metrics(s, groups, answer_extractor(set_terms(cfg, s)), len(part))
        if "greedy" in s.metrics and greedy is not None:
            groups = sample_groups(rollout, reward, part, greedy, 1, progress=progress)
            values["greedy"] = sum(bool(g.scores) and g.scores[0] > 0.5 for g in groups) / len(part)
        out.update({key + k: float(v) for k, v in values.items()})
    return out


def held_out_eval(
    cfg: Config, rollout, reward, prompts: list[Prompt], eos_id: int, console, *, greedy: bool
) -> dict[str, float]:
    """The held-out metrics at ``eval.temperature`` (``greedy``: at 0): every set's of
    ``eval.sets``, or :func:`evaluate`'s, with a phase on ``console`` showing the samples."""
    params = build.eval_params(cfg, eos_id, greedy=greedy)
    label = eval_label(len(prompts), cfg.eval.samples, params.temperature, len(cfg.eval.sets))
    with console.phase(label) as progress:
        if not cfg.eval.sets:
            return evaluate(
                rollout, reward, prompts, params, samples=cfg.eval.samples, progress=progress
            )
        # every metric of every set, greedy included, each time
        greedy_params = build.eval_params(cfg, eos_id, greedy=True)
        return evaluate_sets(cfg, rollout, reward, prompts, params, greedy_params, progress)


def per_set_summary(cfg: Config, first: dict, final: dict) -> dict[str, dict]:
    """``{set: {metric_start, metric_end, problems}}`` for summary.json."""
    out: dict[str, dict] = {}
    for s in cfg.eval.sets:
        key = f"{PREFIX}{s.name}/"
        entry: dict = {"problems": first.get(key + "problems")}
        for m in [*s.metrics, "reward_mean"]:
            entry[f"{m}_start"] = first.get(key + m)
            entry[f"{m}_end"] = final.get(key + m)
        out[s.name] = entry
    return out
