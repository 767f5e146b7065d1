"""Every knob acts: each numeric and enum key a shipped recipe uses under algo, train,
rollout (sampling), reward and sync, changed to another valid value, moves what it should
(the update, the sampled batch, the scores, the bytes sent...) or is refused at load with
a one-line reason. A knob wired to nothing fails here.

Recipes are grouped by algorithm (advantage estimator, policy loss). For each group its
first recipe is probed (``knob_probe.probe``: one loop step on a tiny model through the
loop's own builders); the algo keys are walked in every group, the train, rollout and sync
keys in the default recipe and wherever a recipe's value differs from it (the same wiring
reads them for every algorithm), the reward keys of every recipe on fixed completions.
``train.steps`` and ``sync.every``, read only by ``loop.train``, have their own test.

The whole walk is slow (330 keys, about 250 probes); the default recipe's walk runs in the fast tier.
``RLPOST_KNOB_RECIPES=grpo_arith,dapo_arith`` limits the slow walk to a few recipes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
import torch

from rlpost.algos import POLICY_LOSSES, Aggregation, get_policy_loss
from rlpost.algos.policy_losses import LossInputs
from rlpost.config import ConfigError, load_config, shipped_recipes
from rlpost.pipeline import build, rules
from rlpost.pipeline.loop import train
from rlpost.types import Completion, Group
from tests.conftest import small_overrides
from tests.integration.knob_probe import probe

SPREAD = "tests.integration.knob_probe:spread_reward"
# the second epoch of a batch is off-policy: ratio clips, KL-to-reference and trust regions bind
OFF_POLICY = {"train.epochs": 2, "train.optim.lr": 0.02}
LOOP_ONLY = {"train.steps", "sync.every"}
SAMPLING = (
    "engine preset prompts_per_step n temperature top_p top_k max_tokens truncated_reward "
    "batch_size share_prefix partial partial_fraction partial_chunk_tokens length_aware"
).split()


def other(*choices):
    """The first of ``choices`` that differs from the current value."""
    return lambda v: next(c for c in choices if c != v)


# key (or parameter name) -> (another value, what it moves, context applied to both runs)
ALTS = {
    "algo.advantage.name": (other("rloo", "grpo"), "update", {}),
    "algo.loss.name": (other("gspo", "ppo_clip"), "update", OFF_POLICY),
    "algo.loss_agg_mode": (other("seq-mean-token-sum", "token-mean"), "update", {}),
    "algo.kl.estimator": (other("k1", "k2"), "update", {**OFF_POLICY, "steps": 2}),
    "algo.kl.beta": (other(0.5, 0.1), "update", {**OFF_POLICY, "steps": 2}),
    "algo.kl.placement": (other("reward", "loss"), "update", {**OFF_POLICY, "steps": 2}),
    "algo.kl.target": (other(0.001, 0.01), "beta", {}),
    "algo.kl.horizon": (other(100, 1000), "beta", {}),
    "algo.rollout_correction.name": (other("seq_mask", "tis"), "update", {}),
    "algo.rollout_correction.cap": (other(1.5, 3.0), "update", {}),
    "algo.rollout_correction.low": (other(0.9, 0.5), "update", {}),
    "algo.rollout_correction.high": (other(1.5, 5.0), "update", {}),
    "algo.old_logprobs": (other("rollout", "trainer"), "update", {}),
    "algo.entropy_coef": (other(0.1, 0.0), "update", {}),
    "algo.nll_coef": (other(0.5, 0.0), "update", {}),
    "algo.dynamic_sampling": (lambda v: not v, "rounds", {"rollout.temperature": 0.0}),
    "algo.max_sampling_rounds": (other(1, 2), "rounds", {"rollout.temperature": 0.0}),
    # the chosen estimator's and loss's parameters (algo.advantage.<name>, algo.loss.<name>)
    "norm_by_std": (other(False, True), "update", {}),
    "std_scope": (other("batch", "group"), "update", {}),
    "eps": (other(0.5, 1.0), "update", {}),
    "gamma": (other(0.5, 0.9), "update", {}),
    "lam": (other(0.5, 0.9), "update", {}),
    "alpha": (other(0.2, 0.5), "update", {}),
    "value_lam": (other(0.5, 0.9), "update", {}),
    "clip_low": (other(0.0, 0.1), "update", OFF_POLICY),
    "clip_high": (other(0.0, 0.1), "update", OFF_POLICY),
    # the dual clip binds on A < 0 tokens whose ratio rose past c, which one small step of a
    # tiny model does not make: the configured loss is run on an off-policy batch instead
    "clip_ratio_c": (other(1.0001, 2.0), "loss_fn", {}),
    "dual_clip": (other(False, True), "loss_fn", {}),
    "tis_cap": (other(0.5, 0.9), "update", {}),
    "tau_pos": (other(3.0, 1.0), "update", {}),
    "tau_neg": (other(3.0, 1.0), "update", {}),
    "divergence": (other("tv", "binary_kl"), "loss_fn", {}),
    "tr_kl": (other(1e-6, 0.5), "update", {**OFF_POLICY, "sync.codec": "bf16"}),
    "tr_tv": (other(1e-6, 0.5), "update", {**OFF_POLICY, "sync.codec": "bf16"}),
    "is_cap": (other(0.5, 0.9), "update", {}),
    "reg_coef": (other(5.0, 1.0), "update", OFF_POLICY),
    "kl_cov_ratio": (other(1.0, 0.5), "update", OFF_POLICY),
    "ppo_kl_coef": (other(10.0, 1.0), "update", OFF_POLICY),
    "clip_cov_ratio": (other(1.0, 0.5), "update", OFF_POLICY),
    "clip_cov_lb": (other(-10.0, 0.0), "update", OFF_POLICY),
    "clip_cov_ub": (other(10.0, 1.0), "update", OFF_POLICY),
    "train.optim.lr": (lambda v: v * 10, "update", {}),
    "train.optim.warmup_steps": (other(0, 5), "update", {}),
    "train.optim.weight_decay": (other(0.5, 0.0), "update", {}),
    "train.optim.betas": (other((0.5, 0.9), (0.9, 0.999)), "update", OFF_POLICY),
    "train.optim.grad_clip": (other(1e-6, 1.0), "update", {}),
    "train.mini_batch_size": (lambda v: v // 2 if v > 1 else 2, "update", {}),
    "train.micro_batch_size": (lambda v: v // 2 if v > 1 else 2, "passes", {}),
    "train.epochs": (lambda v: v + 1, "update", {}),
    # the token budget cuts the loss pass into more, smaller micro-batches (packed, it counts
    # real tokens and a group's prompt once: 8 is below one row of the probe's batch)
    "train.max_tokens_per_micro_batch": (other(8, 0), "passes", {}),
    # a chunk below the logits' size takes the chunked head (its own summation order)
    "train.logits_chunk_tokens": (other(4, 0), "update", {}),
    # packed rows carry no padding: the trainer's passes read fewer tokens
    "train.packing": (other("on", "off"), "passes", {}),
    "rollout.engine": (other("vllm", "hf"), "batch", {}),
    "rollout.preset": (other("rlhf", "rlvr"), "batch", {}),
    "rollout.prompts_per_step": (lambda v: v + 1, "batch", {}),
    "rollout.n": (lambda v: v + 1, "batch", {}),
    "rollout.temperature": (other(0.5, 1.0), "batch", {}),
    "rollout.top_p": (other(0.5, 1.0), "batch", {}),
    "rollout.top_k": (other(2, -1), "batch", {}),
    "rollout.max_tokens": (lambda v: max(1, v - 1), "batch", {}),
    "rollout.truncated_reward": (other(None, 0.0), "fixed_scores", {}),
    "rollout.batch_size": (other(1, 2), "passes", {}),
    "rollout.share_prefix": (lambda v: not v, "passes", {}),
    "rollout.partial": (lambda v: not v, "metrics", {}),
    "rollout.partial_fraction": (other(0.5, 0.8), "batch", {}),
    "rollout.partial_chunk_tokens": (other(4, 8), "batch", {}),
    "rollout.length_aware": (lambda v: not v, "order", {}),
    "reward.alpha": (other(0.5, 0.2), "fixed_scores", {}),
    "reward.invalid_score": (other(1.0, 0.0), "fixed_scores", {"reward.score_range": [0.6, 10.0]}),
    "reward.score_range": (other((0.6, 10.0), (-10.0, 10.0)), "fixed_scores", {}),
    "reward.sample_every": (other(1, 2), "samples", {}),
    "reward.sample_count": (other(2, 3), "samples", {"reward.sample_every": 1}),
    "weight": (lambda v: v * 2 if v else 1.0, "fixed_scores", {}),
    "kind": (other("rule", "verifiable"), "fixed_scores", {}),
    "cache_len": (lambda v: v + 1, "fixed_scores", {}),
    "sync.channel.name": (other("http", "inprocess"), "sync", {}),
    "sync.codec.name": (other("bf16", "none"), "sync", {}),
    "sync.bucket_mb": (other(1.0, 2.0), "sync", {}),
    "sync.codec.delta": (lambda v: not v, "sync", {}),
    "sync.codec.delta_full_threshold": (other(0.5, 0.3), "sync", {}),
    "sync.verify": (lambda v: not v, "sync", {}),
    "sync.timeout_s": (other(10.0, 20.0), "sync", {}),
}
# on-policy distillation: eps acts on the task term only, so the context turns it on
ALTS.update(
    {
        "on_policy_distill.eps": (other(0.5, 1.0), "update", {"algo.advantage.task_weight": 1.0}),
        "distill_weight": (other(2.0, 1.0), "update", {}),
        "task_weight": (other(1.0, 0.5), "update", {}),
        "center": (other(True, False), "update", {}),
        "gkd.divergence": (other("reverse_kl", "forward_kl"), "loss_fn", {}),
        # beta mixes the two distributions of the generalised JSD only
        "gkd.beta": (other(0.25, 0.5), "loss_fn", {"algo.loss.divergence": "jsd"}),
    }
)


def small(cfg_dict: dict) -> dict:
    """Overrides that shrink a recipe to a tiny model and an 8-sample batch, keeping its
    ratios (samples per prompt, optimizer steps per batch)."""
    r, t = cfg_dict["rollout"], cfg_dict["train"]
    n = min(r["n"], 4)
    prompts = 8 // n
    batch, old_batch = prompts * n, r["prompts_per_step"] * r["n"]
    mini = max(1, batch * t["mini_batch_size"] // old_batch)
    micro = max(1, mini * t["micro_batch_size"] // t["mini_batch_size"])
    return {
        "model.tiny.hidden_size": 16,
        "model.tiny.intermediate_size": 32,
        "model.tiny.num_hidden_layers": 1,
        "critic.head_start_steps": 0,  # a policy that waits for its critic trains nothing at first
        "sft.steps": 0,
        "rollout.n": n,
        "rollout.prompts_per_step": prompts,
        "rollout.max_tokens": min(r["max_tokens"], 8),
        "train.mini_batch_size": mini,
        "train.micro_batch_size": micro,
        "observe.progress": False,
    } | SMALL_TASKS.get(cfg_dict["data"]["task"]["name"], {})


SMALL_TASKS = {
    "arith": {"data.task.train_size": 64, "data.task.eval_size": 8},
    "code": {"data.task.train_size": 16, "data.task.eval_size": 4},
}


def as_overrides(d: dict) -> list[str]:
    out = []
    for k, v in d.items():
        if k == "steps":
            continue
        v = "null" if v is None else list(v) if isinstance(v, tuple) else v
        out.append(f"{k}={v}")
    return out


@dataclass
class Recipe:
    name: str
    resolved: dict
    extra: dict  # what it needs to load here (a model, a data file)


def leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from leaves(v, key + ".")
        else:
            yield key, v


def knobs(recipe: Recipe) -> list[tuple[str, object]]:
    """(key, current value) of every numeric and enum key the recipe uses in the walked
    sections, plus every parameter its estimator and loss take (None: their default)."""
    d = recipe.resolved
    out = [(f"rollout.{k}", d["rollout"][k]) for k in SAMPLING]
    for section in ("train", "sync"):
        out += [(k, v) for k, v in leaves(d[section], f"{section}.") if k != "sync.codec.keep_bf16"]
    out += list(leaves(d["algo"], "algo."))  # a choice's leaves are its chosen variant's
    w = d["reward"]
    out += [(f"reward.{k}", w[k]) for k in ("alpha", "invalid_score", "score_range")]
    out += [(f"reward.{k}", w[k]) for k in ("sample_every", "sample_count")]
    for i, term in enumerate(w["terms"]):
        out += [
            (f"reward.terms.{i}.weight", term["weight"]),
            (f"reward.terms.{i}.kind", term["kind"]),
        ]
        out += [
            (f"reward.terms.{i}.{k}", v)
            for k, v in term.items()
            if k not in ("name", "weight", "kind")
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
    return out


def alt_for(key: str, algo: dict):
    """The alternative of ``key``: by key, by the chosen variant's parameter
    (``gkd.beta``), or by parameter name."""
    if key in ALTS:
        return ALTS[key]
    section, _, leaf = key.rpartition(".")
    chosen = {"algo.loss": algo["loss"]["name"], "algo.advantage": algo["advantage"]["name"]}
    return ALTS.get(f"{chosen.get(section)}.{leaf}") or ALTS[leaf]


def load(recipe: Recipe, extra: dict):
    """The recipe's config with ``extra`` overrides, or the one-line refusal."""
    try:
        cfg = load_config(recipe.name, as_overrides({**recipe.extra, **extra}))
        rules.check(cfg)
    except ConfigError as exc:
        return None, str(exc)
    return cfg, None


def fixed_groups(cfg) -> list[Group]:
    """One prompt answered right, wrong, right but cut off, and right at the length limit."""
    prompts, _, _ = build.build_data(cfg)
    p = prompts[0]
    right = str(p.answer if not isinstance(p.answer, list) else p.answer[0])
    cap = cfg.rollout.max_tokens

    def c(text, finish, tokens):
        return Completion([1, 2], [5] * tokens, [-0.5] * tokens, finish, 0, 0, text=text)

    completions = [
        c(right, "stop", 2),
        c("x", "stop", 2),
        c(right, "length", cap),
        c(right, "stop", cap),
    ]
    return [Group(p, completions)]


def fixed_scores(cfg) -> str:
    reward = build.build_reward_worker(cfg)
    try:
        scored = reward.score(fixed_groups(cfg), cfg.rollout.max_tokens)
        return repr(([(g.scores, g.invalid) for g in scored], reward.verifiable_accuracy(scored)))
    finally:
        reward.close()


def configured_loss(cfg) -> str:
    """The configured policy loss, with the configured parameters and aggregation, on a
    batch far off-policy: ratios from 1/8 to 8 on tokens of either advantage sign, and an
    engine whose logprobs differ from the trainer's."""
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=gen) * 2
    old = lp + (torch.rand(4, 6, generator=gen) - 0.5) * 4.2
    rollout = old + (torch.rand(4, 6, generator=gen) - 0.5)
    adv = torch.randn(4, 6, generator=gen)
    mask = torch.ones(4, 6)
    full = {}  # a distillation loss reads the student's and the teacher's whole distributions
    if POLICY_LOSSES.trait(cfg.algo.loss.name, "needs_teacher_logits"):
        full = {k: torch.randn(4, 6, 11, generator=gen) * 2 for k in ("logits", "teacher_logits")}
    x = LossInputs(
        lp.clamp(max=0.0), old.clamp(max=0.0), adv, mask, Aggregation(cfg.algo.loss_agg_mode),
        rollout_logprobs=rollout.clamp(max=0.0), **full,
    )  # fmt: skip
    out = get_policy_loss(cfg.algo.loss.name)(x, cfg.algo.loss)
    return repr(
        [round(float(out.loss), 7)]
        + [(k, round(float(v), 7)) for k, v in sorted(out.stats.items())]
    )


def decode_order(cfg) -> str:
    """The order prompts reach the engine once the length predictor has seen them."""
    torch.manual_seed(cfg.run.seed)
    model, tokenizer = build.build_policy(cfg)
    rollout = build.build_rollout_worker(cfg, model, tokenizer)
    prompts = build.build_data(cfg)[0][:4]
    if rollout.lengths is not None:  # a predictor after some steps: the first prompt runs long
        for i, p in enumerate(prompts):
            rollout.lengths.observe(p, [8 - i])
    params = build.sampling_params(cfg, tokenizer.eos_token_id)
    groups = rollout.generate(prompts, params, 1, train=True).groups
    rollout.close()
    return repr([g.prompt.text for g in groups])


class Walk:
    """Probes of one recipe, cached by the overrides they ran with."""

    def __init__(self, recipe: Recipe, tmp_path):
        self.recipe, self.tmp, self.cache, self.state, self.prompts = (
            recipe,
            tmp_path,
            {},
            None,
            None,
        )
        self.base = {
            **small(recipe.resolved),
            "reward.sample_every": recipe.resolved["reward"]["sample_every"],
        }

    def observe(self, cfg, what: str, steps: int) -> str:
        if what == "fixed_scores":
            return fixed_scores(cfg)
        if what == "order":
            return decode_order(cfg)
        if what == "loss_fn":
            return configured_loss(cfg)
        if self.state is None:
            model, _ = build.build_policy(cfg)
            self.state = {k: v.clone() for k, v in model.state_dict().items()}
            self.prompts = build.build_data(cfg)[0]
        run_dir = self.tmp / f"p{len(self.cache)}"
        return probe(cfg, self.prompts, self.state, run_dir, steps=steps)[what]

    def measure(self, extra: dict, what: str, steps: int):
        key = (tuple(sorted((k, repr(v)) for k, v in extra.items())), what, steps)
        if key not in self.cache:
            cfg, refused = load(self.recipe, extra)
            self.cache[key] = (
                ("refused", refused) if cfg is None else ("ran", self.observe(cfg, what, steps))
            )
        return self.cache[key]

    def knob(self, key: str, value) -> str:
        """'moved', 'refused: why', or a failure message."""
        make, what, context = alt_for(key, self.recipe.resolved["algo"])
        learn = {} if what == "fixed_scores" else self._learning_terms()
        context = {**self.base, **learn, **context}
        steps = context.pop("steps", 1)
        value = context.get(key, value)  # the probe's (shrunk) value of the key
        new = make(value)
        base = self.measure(context, what, steps)
        assert base[0] == "ran", f"{self.recipe.name}: the baseline of {key} was refused: {base[1]}"
        got = self.measure({**context, key: new}, what, steps)
        if got[0] == "refused":
            why = got[1]
            assert "\n" not in why.strip(), f"{key}={new}: refusal is not one line: {why!r}"
            return f"refused: {why}"
        if got[1] == base[1]:
            return f"FAILED: {key}={value!r} -> {new!r} moved nothing in {what!r}"
        return "moved"

    def _learning_terms(self) -> dict:
        """The recipe's reward terms plus one that spreads every group, so an update moves."""
        terms = [dict(t) for t in self.recipe.resolved["reward"]["terms"]]
        terms.append({"name": SPREAD, "weight": 1.0, "kind": "rule"})
        return {"reward.terms": terms, "rollout.truncated_reward": None}


def recipe_extra(name: str, tmp_path, tiny_dir) -> dict:
    if name == "grpo_file":
        rows = tmp_path / "rows.jsonl"
        rows.write_text(
            "".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(20))
        )
        return {
            "model.path": str(tiny_dir),
            "data.task.train_path": str(rows),
            "data.task.eval_path": str(rows),
        }
    if name.startswith("distill_"):  # a teacher with the tiny student's tokenizer
        return {"model.teacher.path": str(tiny_dir)}
    return {}


def groups_of_recipes(tmp_path, tiny_dir, only: str | None) -> dict[tuple[str, str], list[Recipe]]:
    """Shipped recipes by (advantage, policy loss); ``only``: a comma list of names."""
    out: dict[tuple[str, str], list[Recipe]] = {}
    for path in shipped_recipes():
        name = path.stem
        if name in ("dpo_prefs", "sft_chat", "rm_prefs"):  # no RL stage: keys not walked here
            continue
        if name == "rlhf_arith":  # grpo_arith's algorithm; it needs an rlpost rm output first
            continue
        if only and name not in only.split(","):
            continue
        extra = recipe_extra(name, tmp_path, tiny_dir)
        cfg = load_config(name, as_overrides(extra))
        resolved = cfg.model_dump()
        key = (cfg.algo.advantage.name, cfg.algo.loss.name)
        out.setdefault(key, []).append(Recipe(name, resolved, extra))
    for members in out.values():  # the arith recipe first: the cheapest to probe
        members.sort(key=lambda r: (not r.name.endswith("_arith"), r.name))
    return out


ALGORITHM_KEYS = ("algo.advantage.name", "algo.loss.name")


def skip(key, value, recipe, index, default, default_knobs, first: set) -> bool:
    """Walked elsewhere with the same wiring: algo.advantage.name and algo.loss.name in each
    group's first recipe, an estimator's or a loss's parameters in the first recipe that
    uses it, the other algo, train, rollout and sync keys in the default recipe (and
    wherever a recipe's value differs from it); reward keys in every recipe."""
    if key.startswith("reward.") or recipe is default:
        return False
    a = recipe.resolved["algo"]
    if key.startswith(ALGORITHM_KEYS):
        return index > 0
    for part in ("advantage", "loss"):  # a variant's parameters: where it is first used
        if key.startswith(f"algo.{part}."):
            return (part, a[part]["name"]) not in first
    return default_knobs.get(key, object()) == value


REPORT: dict[str, dict[str, int]] = {}


@pytest.mark.slow
def test_every_knob_of_every_recipe_acts(tmp_path, tiny_dir, capsys):
    walk_recipes(tmp_path, tiny_dir, capsys, os.environ.get("RLPOST_KNOB_RECIPES"))


def test_every_knob_of_the_default_recipe_acts(tmp_path, tiny_dir, capsys):
    walk_recipes(tmp_path, tiny_dir, capsys, "grpo_arith")


def walk_recipes(tmp_path, tiny_dir, capsys, only: str | None) -> None:
    torch.set_num_threads(1)
    start = time.perf_counter()
    groups = groups_of_recipes(tmp_path, tiny_dir, only)
    default = next((r for g in groups.values() for r in g if r.name == "grpo_arith"), None)
    default = default or next(iter(groups.values()))[0]
    default_knobs = dict(knobs(default))
    failures, counts, claimed = [], {}, set()
    for members in groups.values():
        for i, recipe in enumerate(members):
            a = recipe.resolved["algo"]
            mine = {("advantage", a["advantage"]["name"]), ("loss", a["loss"]["name"])} - claimed
            claimed |= mine
            walk = Walk(recipe, tmp_path / recipe.name)
            walked = refused = 0
            for key, value in knobs(recipe):
                if key in LOOP_ONLY:
                    continue
                if skip(key, value, recipe, i, default, default_knobs, mine):
                    continue
                result = walk.knob(key, value)
                walked += 1
                refused += result.startswith("refused")
                if result.startswith("FAILED"):
                    failures.append(f"{recipe.name}: {result}")
            counts[recipe.name] = {"walked": walked, "refused": refused, "keys": len(knobs(recipe))}
    seconds = time.perf_counter() - start
    REPORT.update(counts)
    with capsys.disabled():
        print(f"\nknob walk: {seconds:.1f} s")
        for name, c in sorted(counts.items()):
            print(f"  {name}: {c['walked']} walked ({c['refused']} refused) of {c['keys']} keys")
    assert not failures, "\n".join(failures)


def test_loop_knobs_act(tmp_path):
    """train.steps and sync.every, read by loop.train only: the steps run and the versions served."""
    quick = {"eval.every": 0, "eval.limit": 2, "checkpoint.every": 0, "sft.steps": 0}

    def run(name, **extra):
        over = small_overrides(tmp_path / name, **{**quick, **extra})
        return train(load_config(None, over)).history

    one, two = run("a", **{"train.steps": 2}), run("b", **{"train.steps": 3})
    assert (len(one), len(two)) == (2, 3)
    every = run("c", **{"train.steps": 3, "sync.every": 2})
    assert [h["policy_version"] for h in one] == [0.0, 1.0]
    lag = [h["sample_lag"] for h in every]
    assert [h["sync_bytes"] > 0 for h in every] == [False, True, True] and max(lag) >= 1
