"""``rlpost``: the command line.

    rlpost train [RECIPE] [key=value ...] [--resume RUN_DIR]
    rlpost sft [RECIPE] [key=value ...]        warm-up only, saves RUN_DIR/sft_model
    rlpost dpo [RECIPE] [key=value ...]        offline preference optimisation
    rlpost rm [RECIPE] [key=value ...]         reward model on preference pairs (RUN_DIR/rm_model)
    rlpost eval [RECIPE] [key=value ...]       held-out accuracy of model.path
    rlpost config [RECIPE] [key=value ...]     print the resolved config, checked as train does
                                               (--keys: every key; --for dpo|eval|sft|rm)
    rlpost recipes                             the recipes installed with rlpost
    rlpost rewards                             the registered rewards and their parameters
    rlpost report RUN_DIR [RUN_DIR ...]        HTML report and a text summary (several: overlaid)
    rlpost export RUN_DIR|MODEL|tinker://... --out DIR [--gguf f32|f16|bf16|q8_0] [--overwrite]
                                               the policy as an HF directory (and a GGUF file)
    rlpost sandbox run FILE.py [--timeout S] [--memory MB] [--json]
    rlpost sandbox check [--run-limits MODE]   which sandbox limits hold on this host
    rlpost serve [--model DIR|X.gguf] [--port N] OpenAI-compatible rollout server
    rlpost tinker --model NAME=PATH [--port N]  the Tinker training API, served locally
    rlpost cluster scale --rollout N RUN_DIR   grow or shrink a running job's rollout fleet

A bad config is one line on stderr and exit code 2, before any work starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

# OpenMP threads that spin while they wait hold a core another process needs, and a
# run beside a busy core collapses (docs/performance.md, bench/bench_threads.py). The
# runtime reads this once, when torch loads it, so it is set before anything imports
# torch; a value the user set stands.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from rlpost.config import (
    RECIPES_DIR,
    ConfigError,
    describe_fields,
    dump_config,
    load_config,
    shipped_recipes,
)

DEFAULT_RECIPE = RECIPES_DIR / "grpo_arith.yaml"
EXIT_USAGE = 2


def _fail(message: str) -> int:
    print(f"rlpost: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """(recipe path or None, overrides): the first item without '=' is the recipe."""
    recipe = None
    overrides = []
    for item in items:
        if "=" not in item and recipe is None:
            recipe = item
        else:
            overrides.append(item)
    if recipe is None and DEFAULT_RECIPE.is_file():
        recipe = str(DEFAULT_RECIPE)
    return recipe, overrides


def _quiet_libraries() -> None:
    from rlpost.models.loading import quiet_transformers

    quiet_transformers()


def _resume_recipe(args, recipe: str | None) -> str | None:
    """Resuming without a recipe continues with the config the run was started with."""
    if not getattr(args, "resume", None):
        return recipe
    if not (Path(args.resume) / "config.yaml").is_file():
        raise ConfigError(f"--resume {args.resume!r} is not a run directory (no config.yaml)")
    if any("=" not in i for i in args.items):
        return recipe
    return str(Path(args.resume) / "config.yaml")


def _command_config(args, default: str | None = None):
    """The command's config, checked against the rule table as the command
    (rlpost.pipeline.rules): its recipe (the shipped ``default`` in place of the default
    recipe), overrides, or the run's own config when resuming without a recipe."""
    from rlpost.pipeline.rules import check

    recipe, overrides = _split_args(args.items)
    if getattr(args, "overwrite", False):
        overrides.append("run.overwrite=true")
    if default is not None and recipe == str(DEFAULT_RECIPE):
        recipe = str(DEFAULT_RECIPE.parent / default)
    cfg = check(load_config(_resume_recipe(args, recipe), overrides), args.command)
    _quiet_libraries()
    return cfg


def cmd_train(args) -> int:
    cfg = _command_config(args)
    from rlpost.cluster import starter
    from rlpost.errors import WorkerError
    from rlpost.pipeline.interrupts import Interrupts
    from rlpost.pipeline.loop import TrainingStopped, train
    from rlpost.registry import UserCodeError

    resume = Path(args.resume) if args.resume else None
    run_dir = resume or cfg.run_dir
    with Interrupts() as interrupts:
        try:
            train(cfg, resume=resume, stop=interrupts.stop, start=starter(cfg))
        except TrainingStopped as exc:
            print(f"rlpost: {exc}", file=sys.stderr)
            return 1
        except (WorkerError, UserCodeError) as exc:  # outside a step: what was saved stands
            print(f"rlpost: {exc}; continue with rlpost train --resume {run_dir}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return _interrupted(args, run_dir, interrupts.exit_code)
    if interrupts.stop.is_set():
        return _interrupted(args, run_dir, interrupts.exit_code, total=cfg.train.steps)
    return 0


def _interrupted(
    args, run_dir: Path, code: int, total: int | None = None, where: str | None = None
) -> int:
    """Say where an interrupted run stands (``where``: as the caller says) and the exact
    command that continues it."""
    from rlpost.pipeline.rundir import SFT_STATE
    from rlpost.train.checkpoint import latest_checkpoint, latest_step

    if not (run_dir / "config.yaml").is_file():
        print("rlpost: interrupted before the run directory was created", file=sys.stderr)
        return code
    step = latest_step(latest_checkpoint(run_dir))
    if total is not None and step >= total:
        return 0  # the signal came during the last step: the run is complete
    if where is None and (run_dir / SFT_STATE).is_dir():
        where = "during the warm-up (its state is saved)"
    elif where is None:
        where = f"with a checkpoint at step {step}" if step else "before the first checkpoint"
    items = [i for i in args.items if not (args.resume and i == args.resume)]
    command = shlex.join(["rlpost", args.command, *items, "--resume", str(run_dir)])
    print(f"rlpost: stopped {where}; continue with:\n  {command}", file=sys.stderr)
    return code


def cmd_sft(args) -> int:
    cfg = _command_config(args)
    from rlpost.commands.offline import run_conversation_sft
    from rlpost.pipeline.console import Console
    from rlpost.pipeline.interrupts import Interrupts
    from rlpost.pipeline.rundir import prepare_run_dir, warm_start

    resume = Path(args.resume) if args.resume else None
    run_dir, console = resume or cfg.run_dir, Console(cfg.observe.progress)
    with Interrupts() as interrupts:
        try:
            if cfg.sft.data != "task":
                out = run_conversation_sft(cfg, resume, console)
                print(f"conversation SFT model saved to {out} (use it as model.path)")
                return 0
            _, train_prompts, _ = prepare_run_dir(cfg, resume)
            warm_start(cfg, run_dir, train_prompts, console, skip_sft=False)
        except KeyboardInterrupt:
            return _interrupted(args, run_dir, interrupts.exit_code)
    print(f"warm-up policy saved to {run_dir / 'sft_model'}")
    return 0


def cmd_eval(args) -> int:
    cfg = _command_config(args)
    from rlpost.pipeline import build
    from rlpost.pipeline.console import Console
    from rlpost.pipeline.eval_sets import held_out_eval
    from rlpost.pipeline.rundir import load_policy_shown

    _, held_out, _ = build.build_data(cfg)
    if not held_out:
        raise ConfigError("nothing to evaluate: no held-out prompt was loaded")
    if cfg.eval.limit and not cfg.eval.sets:  # eval.sets: applied to each set at load
        held_out = held_out[: cfg.eval.limit]
    console = Console(cfg.observe.progress)
    model, tokenizer = load_policy_shown(cfg, console)
    rollout = build.build_rollout_worker(cfg, model, tokenizer)
    reward = build.build_reward_worker(cfg)
    try:  # eval.sets: eval/<set>/<metric>, as a training run reports them
        eos = tokenizer.eos_token_id
        result = held_out_eval(cfg, rollout, reward, held_out, eos, console, greedy=False)
    finally:
        rollout.close()
        reward.close()
    for k, v in result.items():
        print(f"{k}: {v:.4f}")
    return 0


OFFLINE = {  # command: (default recipe, driver in commands.offline, what it says at the end)
    "dpo": ("dpo_prefs.yaml", "run_dpo", None),
    "rm": ("rm_prefs.yaml", "run_rm", "reward model saved to {} (the reward_model reward's path)"),
}


def cmd_offline(args) -> int:
    """``rlpost dpo`` and ``rlpost rm``: ``commands.offline.<run>``, stopped by Ctrl-C with
    the command that continues it."""
    recipe, run, saved = OFFLINE[args.command]
    cfg = _command_config(args, recipe)
    from rlpost.commands import offline
    from rlpost.pipeline.console import Console
    from rlpost.pipeline.interrupts import Interrupts

    resume = Path(args.resume) if args.resume else None
    run_dir = resume or cfg.run_dir
    with Interrupts() as interrupts:
        try:
            out = getattr(offline, run)(cfg, resume, Console(cfg.observe.progress))
        except KeyboardInterrupt:
            return _interrupted(args, run_dir, interrupts.exit_code, where="(its state is saved)")
    if saved is not None:
        print(saved.format(out))
    return 0


def cmd_export(args) -> int:
    import time

    from rlpost.models.export import export_model
    from rlpost.models.loading import load_policy
    from rlpost.pipeline.rundir import policy_path

    _quiet_libraries()
    started = time.perf_counter()
    if args.source.startswith("tinker://"):  # an adapter of rlpost tinker, merged into its base
        from rlpost.tinker.service import checkpoint_policy

        source, policy = args.source, checkpoint_policy(args.source, Path(args.state_dir))
        loaded = time.perf_counter()
        out = policy.export(args.out, gguf=args.gguf, overwrite=args.overwrite)
    else:
        source = policy_path(Path(args.source))
        model, tokenizer = load_policy(source)
        loaded = time.perf_counter()
        dest, gguf = Path(args.out), args.gguf
        out = export_model(model, tokenizer, dest, gguf_type=gguf, overwrite=args.overwrite)
    done = time.perf_counter()
    print(f"exported {source} (loaded in {loaded - started:.1f}s, written in {done - loaded:.1f}s)")
    for kind, path in out.items():
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        print(f"  {kind}: {path} ({size / 2**20:.1f} MiB)")
    return 0


def config_keys(cfg) -> list[tuple[str, str, str]]:
    """(key, value, help) of the keys ``rlpost config --keys`` lists: the values this config
    runs with, the chosen parts' keys only, unchecked against a command (a train path may
    come later)."""
    from rlpost.pipeline.rules import unread_keys

    unread = tuple(f"{k}." for k in unread_keys(cfg))
    return [row for row in describe_fields(values=cfg) if not f"{row[0]}.".startswith(unread)]


def cmd_config(args) -> int:
    from rlpost.pipeline.rules import check, command_for

    recipe, overrides = _split_args(args.items)
    cfg = load_config(recipe, overrides)
    if args.keys:
        for key, value, help_text in config_keys(cfg):
            print(f"{key} = {value}\n    {' '.join(help_text.split())}")
        return 0
    check(cfg, args.check_as or command_for(cfg))
    print(dump_config(cfg), end="")
    return 0


def cmd_recipes(args) -> int:
    """The shipped recipes, each with the first line of its header comment."""
    for path in shipped_recipes():
        lines = [x.lstrip("# ").strip() for x in path.read_text().splitlines()]
        about = next((x for x in lines if x and not x.startswith(("base:", "run:"))), "")
        print(f"{path.stem:<22} {about}")
    print(f"\n{len(shipped_recipes())} recipes in {RECIPES_DIR}; run one with rlpost train NAME")
    return 0


def cmd_rewards(args) -> int:
    from rlpost.rewards.catalog import describe_rewards

    for name, kind, params, doc in describe_rewards():
        print(f"{name} ({kind})\n    {doc}\n    params: {params or '-'}")
    print("\nor package.module:function for your own (see reward.terms in rlpost config --keys)")
    return 0


# Commands that own their arguments (and --help): the rest of the line goes to the module's
# main() unparsed.
OWN_ARGS = {
    "report": ("rlpost.observe.report", "HTML report of a run, or several overlaid"),
    "serve": ("rlpost.rollout.serve.server", "OpenAI-compatible rollout server"),
    "tinker": ("rlpost.tinker.service", "the Tinker training API, served locally"),
    "cluster": ("rlpost.cluster.control", "a running job's workers"),
    "sandbox": ("rlpost.rewards.sandbox.cli", "run untrusted code in the sandbox"),
}


def _own_args(command: str, rest: list[str]) -> int:
    import importlib

    if command in ("serve", "tinker"):
        _quiet_libraries()
    return importlib.import_module(OWN_ARGS[command][0]).main(rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlpost", description="RL post-training of language models.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, text in [
        ("train", cmd_train, "RL training (GRPO by default): warm-up, rollout, reward, update, eval"),
        ("sft", cmd_sft, "supervised warm-up only"),
        ("eval", cmd_eval, "held-out accuracy of a policy"),
        ("dpo", cmd_offline, "offline preference optimisation (DPO / IPO)"),
        ("rm", cmd_offline, "reward model on preference pairs (Bradley-Terry)"),
    ]:  # fmt: skip
        sp = sub.add_parser(name, help=text)
        sp.add_argument("items", nargs="*", help="recipe YAML, then key=value overrides")
        sp.set_defaults(fn=fn)
        if name != "eval":  # the commands that write a run directory
            overwrite = "replace an existing run directory of the same name (deletes its files)"
            sp.add_argument("--overwrite", action="store_true", help=overwrite)
            resume = "continue from the run's latest checkpoint"
            sp.add_argument("--resume", metavar="RUN_DIR", help=resume)
    sp = sub.add_parser(
        "config", help="print the resolved config; --keys lists every key, its value and help"
    )
    sp.add_argument("items", nargs="*")
    keys = "list every config key with the value the recipe gives it, and its help"
    sp.add_argument("--keys", action="store_true", help=keys)
    check_as = (
        "check the config as this command would (default: dpo for data.task=prefs, else train)"
    )
    sp.add_argument(
        "--for", dest="check_as", choices=["train", "sft", "eval", "dpo", "rm"], help=check_as
    )
    sp.set_defaults(fn=cmd_config)
    export = "write a run's policy (or any model) as an HF directory and a GGUF file"
    sp = sub.add_parser("export", help=export)
    source = "run directory, checkpoint, HF checkpoint directory, .gguf file or tinker:// path"
    sp.add_argument("source", help=source)
    sp.add_argument("--state-dir", default="tinker_state", help="rlpost tinker's, for tinker://")
    sp.add_argument("--out", required=True, help="directory to write (the HF checkpoint)")
    gguf = "also write OUT/gguf/model-TYPE.gguf for llama.cpp-family runtimes (Llama models)"
    sp.add_argument("--gguf", choices=["f32", "f16", "bf16", "q8_0"], help=gguf)
    sp.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    sp.set_defaults(fn=cmd_export)
    sp = sub.add_parser("recipes", help="list the recipes installed with rlpost")
    sp.set_defaults(fn=cmd_recipes)
    sp = sub.add_parser("rewards", help="list the registered rewards and their parameters")
    sp.set_defaults(fn=cmd_rewards)
    for name, (_, text) in OWN_ARGS.items():
        sp = sub.add_parser(name, help=f"{text} (rlpost {name} --help)", add_help=False)
        sp.add_argument("rest", nargs=argparse.REMAINDER)
        sp.set_defaults(fn=lambda a, name=name: _own_args(name, a.rest))
    return p


def main(argv: list[str] | None = None) -> int:
    from rlpost.observe.memory import bound_kernel_caches

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    bound_kernel_caches()  # before any kernel is built; a run's memory grows with its shapes
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in OWN_ARGS:
        return _own_args(argv[0], argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow a flag (rlpost config dapo_arith --keys rollout.n=4).
    unknown = [x for x in extra if x.startswith("-") or not hasattr(args, "items")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.items = [*args.items, *extra]
    try:
        return args.fn(args)
    except (FileNotFoundError, ValueError, RuntimeError, ImportError, OSError) as exc:
        from rlpost.data.files import DataError
        from rlpost.models.loading import ModelLoadError
        from rlpost.registry import UserCodeError
        from rlpost.statefile import StateFileError
        from rlpost.sync.session import SyncError

        one_line = (
            ConfigError | ModelLoadError | DataError | StateFileError | SyncError | UserCodeError
        )
        missing_extra = isinstance(exc, ImportError) and "pip install" in str(exc)
        if missing_extra or isinstance(exc, one_line):  # a missing extra names its install
            return _fail(str(exc))
        raise
    except KeyboardInterrupt:
        print("rlpost: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
