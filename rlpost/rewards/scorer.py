"""Turn reward terms into one score per sample.

A term is either a per-sample reward function or a batched scorer (reward
model, judge); both are reduced to one column ``list[float | None]`` per batch,
and everything after that (validation, mixture, components) is one code path.

Without a mixture the final score is the weighted sum of the terms that apply
(``None`` terms are skipped). With ``alpha`` set, verifiable and rule terms form
one part and model / judge terms the other:
``final = alpha * verifiable_part + (1 - alpha) * model_part``. ``build_scorer``
uses ``alpha = 0.8`` when the config leaves it unset and both parts are present,
so a learned or judged signal never outweighs the checkable one by default.

A NaN, an infinity or a score outside ``score_range`` never reaches the
optimizer: the sample's score is replaced by ``invalid_score`` and counted, per
batch in ``ScoredBatch.invalid`` and per term in ``RewardScorer.counters()``. The
same holds for the rewards an episode's turns carry (an environment's, an agent
harness's), which trained beside the terms' score.

:class:`RewardWorker` is the reward role behind the same narrow interface as the
others: it takes :class:`~rlpost.types.Group` records from the rollout stage and returns
them with ``scores``, ``components`` and ``invalid`` filled in. Reward models and judges
hold weights or HTTP clients, so the worker is where they live; the loop sees records.

Reward hacking is found by reading samples, not by reading curves: :class:`SampleWriter`
writes the first ``count`` completions of the batch every ``every`` steps to
``RUN_DIR/samples/step_N.jsonl``, one JSON object per line, with the final score and every
reward component next to the text that earned it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, SupportsFloat

from rlpost.config import ConfigError, RewardConfig
from rlpost.errors import typed_line
from rlpost.registry import UserCodeError, where
from rlpost.rewards.catalog import lookup
from rlpost.rewards.registry import BatchScorer, RewardFn, check_params
from rlpost.statefile import atomic_write
from rlpost.types import Completion, Group, RewardSample, ScoredBatch

VERIFIABLE_KINDS = ("verifiable", "rule")
TRUNCATED = "truncated"  # the component that holds rollout.truncated_reward
DEFAULT_ALPHA = 0.8


@dataclass
class Term:
    """One reward term: a per-sample ``fn`` or a batched ``scorer`` (exactly one)."""

    name: str
    fn: RewardFn | None
    weight: float
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    scorer: BatchScorer | None = None

    def __post_init__(self) -> None:
        if (self.fn is None) == (self.scorer is None):
            raise ValueError(f"reward term {self.name!r} needs exactly one of fn or scorer")

    def column(self, samples: Sequence[RewardSample]) -> list[float | None]:
        """Raw values for ``samples``, in order (``None``: not applicable)."""
        if not samples:
            return []
        try:
            if self.scorer is not None:
                values = list(self.scorer.score(samples))
                if len(values) != len(samples):
                    raise ValueError(
                        f"reward term {self.name!r} returned {len(values)} scores "
                        f"for {len(samples)} samples"
                    )
                return values
            workers = min(int(getattr(self.fn, "concurrency", 1)), len(samples))
            if workers <= 1:
                return [self.call(s) for s in samples]
            with ThreadPoolExecutor(max_workers=workers) as pool:
                return list(pool.map(self.call, samples))
        except UserCodeError:
            raise
        except Exception as exc:
            exc.add_note(f"while scoring reward term {self.name!r}")
            raise

    def call(self, sample: RewardSample) -> float | None:
        """The per-sample function on ``sample``: a float or None; what else it returns, or
        raises, is a UserCodeError naming the function and the sample."""
        try:
            value = self.fn(sample, **self.params)
        except Exception as exc:  # the reward's own code: said in one line, with the sample
            raise self._error(f"raised {typed_line(exc)}", sample) from None
        if value is None:
            return None
        if isinstance(value, str) or not isinstance(value, SupportsFloat):
            raise self._error(f"returned {value!r}, not a float or None", sample)
        return float(value)

    def _error(self, what: str, sample: RewardSample) -> UserCodeError:
        prompt, reply = (
            x if len(x) <= 60 else x[:57] + "..." for x in (sample.prompt, sample.completion)
        )
        return UserCodeError(
            f"reward {self.name!r}: {where(self.fn)} {what} on the sample {prompt!r} -> {reply!r}"
        )


def _spread(values: list[float | None], cut: list[bool]) -> list[float | None]:
    """``values`` of the kept samples back at their positions (``None`` where cut)."""
    it = iter(values)
    return [None if c else next(it) for c in cut]


def _as_float(term: str, raw: Any) -> float | None:
    if raw is None:
        return None
    try:
        return float(raw)
    except (TypeError, ValueError):
        raise TypeError(
            f"reward term {term!r} returned {type(raw).__name__}, not a float"
        ) from None


class RewardScorer:
    """Scores batches of samples with a fixed list of terms."""

    def __init__(
        self,
        terms: list[Term],
        *,
        alpha: float | None = None,
        invalid_score: float = 0.0,
        score_range: tuple[float, float] = (-math.inf, math.inf),
        truncated_reward: float | None = None,
    ) -> None:
        if not terms:
            raise ValueError("reward.terms is empty; add at least one reward term")
        if alpha is not None and not 0.0 <= alpha <= 1.0:
            raise ValueError(f"reward.alpha must be in [0, 1], got {alpha}")
        self.terms = terms
        self.alpha = alpha
        self.invalid_score = invalid_score
        self.score_range = score_range
        self.truncated_reward = truncated_reward
        self.invalid_by_term = dict.fromkeys((t.name for t in terms), 0)

    def _valid(self, value: float | None) -> bool:
        if value is None:
            return True
        lo, hi = self.score_range
        return math.isfinite(value) and lo <= value <= hi

    def score(self, samples: Sequence[RewardSample], *, training: bool = True) -> ScoredBatch:
        """Score a batch: ``scores[i]`` for sample i plus each term's column.

        ``components[name][i]`` is the term's raw value (``nan`` where it does not
        apply or was invalid). With ``truncated_reward`` set, a truncated sample
        (``finish_reason == "length"``) is not scored by the terms: its score is
        ``truncated_reward`` and its only component is ``truncated``, so what is
        logged is what trains. ``training=False`` (held-out evaluation) scores every
        sample by its terms."""
        override = training and self.truncated_reward is not None
        cut = [override and s.finish_reason == "length" for s in samples]
        scored = [s for s, c in zip(samples, cut, strict=True) if not c]
        columns = {
            t.name: _spread([_as_float(t.name, r) for r in t.column(scored)], cut)
            for t in self.terms
        }
        if scored and all(v is None for c in columns.values() for v in c):
            who = ", ".join(f"{t.name!r} ({where(t.fn or t.scorer)})" for t in self.terms)
            raise UserCodeError(
                f"reward: every term returned None (not applicable) for all {len(scored)} samples"
                f" of a batch: {who}; return a float for the samples a term scores"
            )
        components: dict[str, list[float]] = {t.name: [] for t in self.terms}
        components.update(_sub_components(self.terms, len(scored), cut))
        if any(cut):
            components[TRUNCATED] = [self.truncated_reward if c else math.nan for c in cut]
        scores: list[float] = []
        invalid_rows: list[int] = []
        for i, truncated in enumerate(cut):
            parts: dict[str, float] = {}
            bad = False  # a truncated sample's columns are all None: never bad
            for term in self.terms:
                value = columns[term.name][i]
                if not self._valid(value):
                    bad = True
                    self.invalid_by_term[term.name] += 1
                    value = math.nan
                components[term.name].append(math.nan if value is None else value)
                if value is not None and not math.isnan(value):
                    parts[term.name] = value
            combined = self._combine(parts)
            turns = samples[i].episode.turns if samples[i].episode is not None else ()
            if not all(self._valid(t.reward) for t in turns):  # trained even when truncated
                invalid_rows.append(i)
                scores.append(self.invalid_score)
            elif truncated:
                scores.append(float(self.truncated_reward))
            elif bad or not math.isfinite(combined):  # weights can overflow
                invalid_rows.append(i)
                scores.append(self.invalid_score)
            else:
                scores.append(combined)
        return ScoredBatch(
            scores=scores,
            components=components,
            invalid=len(invalid_rows),
            invalid_rows=invalid_rows,
        )

    def _combine(self, parts: dict[str, float]) -> float:
        if self.alpha is None:
            return sum(t.weight * parts[t.name] for t in self.terms if t.name in parts)
        verifiable = model = 0.0
        for t in self.terms:
            if t.name not in parts:
                continue
            if t.kind in VERIFIABLE_KINDS:
                verifiable += t.weight * parts[t.name]
            else:
                model += t.weight * parts[t.name]
        return self.alpha * verifiable + (1.0 - self.alpha) * model

    def verifiable_accuracy(self, scored: ScoredBatch) -> float | None:
        """:func:`verifiable_accuracy` of one scored batch."""
        return verifiable_accuracy(self.terms, [scored.components])

    def counters(self) -> dict[str, int]:
        """Cumulative counts for metrics: invalid scores per term, and each batched
        scorer's own counters (judge retries and failures) as ``term/counter``."""
        out = {f"{name}/invalid": n for name, n in self.invalid_by_term.items()}
        for t in self.terms:
            get = getattr(t.scorer, "counters", None)
            if callable(get):
                out.update({f"{t.name}/{k}": v for k, v in get().items()})
        return out

    def close(self) -> None:
        """Release batched scorers' resources (HTTP clients, model weights)."""
        for t in self.terms:
            close = getattr(t.scorer, "close", None)
            if callable(close):
                close()


def verifiable_accuracy(
    terms: Sequence[Term], components: Iterable[Mapping[str, list[float]]]
) -> float | None:
    """Mean of the ``verifiable``-kind components over every column set (NaNs skipped).

    The signal the hacking monitor compares the reward against; ``None`` when
    no verifiable term applied to any sample."""
    names = {t.name for t in terms if t.kind == "verifiable"}
    values = [v for c in components for n in names for v in c.get(n, []) if not math.isnan(v)]
    return sum(values) / len(values) if values else None


def check_terms(cfg: RewardConfig) -> None:
    """Resolve every term's name and check its params without building anything.

    Config validation uses this, so a reward model is loaded once, by the run,
    never a second time by the check."""
    if not cfg.terms:
        raise ValueError("reward.terms is empty; add at least one reward term")
    for term in cfg.terms:
        kind_of, obj = lookup(term.name)
        check_params(term.name, obj, term.params(), per_sample=kind_of == "sample")


def _build_term(label: str, term: Any) -> Term:
    params = term.params()
    kind_of, obj = lookup(term.name)
    if kind_of == "sample":
        check_params(term.name, obj, params, per_sample=True)
        return Term(label, obj, term.weight, term.kind, params)
    check_params(term.name, obj, params, per_sample=False)
    # A reward model left at the config's default kind ("verifiable") is what the
    # user meant as a model term; an explicitly set kind is respected.
    kind = term.kind
    if "kind" not in term.model_fields_set:
        kind = getattr(obj, "default_kind", kind)
    return Term(label, None, term.weight, kind, params, scorer=obj(**params))


def probe_terms(cfg: RewardConfig, sources: Sequence[Any], prompts: Sequence[Any]) -> None:
    """Call each per-sample reward from the user's code (``file.py:fn``) on the first two rows
    of its source, each row's reference answer as the completion, before any work: an
    exception, a non-number or a NaN is a UserCodeError naming the function and the row."""
    own = {s.name: s.reward for s in sources if s.reward is not None}
    for source, terms in [("", cfg.terms), *own.items()]:
        rows = [p for p in prompts if (p.source if p.source in own else "") == source][:2]
        for t in terms:
            kind, fn = lookup(t.name)
            if ":" not in t.name or kind != "sample":  # the built-ins are held by their tests
                continue
            term = Term(t.name, fn, t.weight, t.kind, t.params())
            for p in rows:
                answer = "" if p.answer is None else str(p.answer)
                sample = RewardSample(p.text, answer, p.answer, p.metadata, source=p.source)
                try:
                    if (value := term.call(sample)) is not None and not math.isfinite(value):
                        raise term._error(f"returned {value}", sample)
                except UserCodeError as exc:  # before any work: a config error
                    raise ConfigError(str(exc)) from None


def build_scorer(cfg: RewardConfig, *, truncated_reward: float | None = None) -> RewardScorer:
    """Resolve every term by name and build batched scorers; errors surface here.

    An unknown name, or a param the reward does not accept, fails before training.
    ``alpha`` defaults as the module docstring says (``DEFAULT_ALPHA``)."""
    terms: list[Term] = []
    seen: set[str] = set()
    for i, term in enumerate(cfg.terms):
        label = term.name if term.name not in seen else f"{term.name}#{i}"
        seen.add(label)
        terms.append(_build_term(label, term))
    alpha = cfg.alpha
    kinds = {t.kind in VERIFIABLE_KINDS for t in terms}
    if alpha is None and kinds == {True, False}:
        alpha = DEFAULT_ALPHA
    return RewardScorer(
        terms,
        alpha=alpha,
        invalid_score=cfg.invalid_score,
        score_range=tuple(cfg.score_range),
        truncated_reward=truncated_reward,
    )


def _sub_components(terms: list[Term], scored: int, cut: list[bool]) -> dict[str, list[float]]:
    """``term/name`` columns a batched scorer kept of its latest batch (``last_components``:
    a verifiers rubric's per-function values), for logging; only the term's value trains."""
    out = {}
    for t in terms:
        parts = getattr(t.scorer, "last_components", None) or {}
        for name, col in parts.items():
            if len(col) == scored:
                out[f"{t.name}/{name}"] = [math.nan if v is None else v for v in _spread(col, cut)]
    return out


def reward_samples(groups: list[Group], max_tokens: int) -> list[RewardSample]:
    """One :class:`RewardSample` per completion, groups in order."""
    return [
        RewardSample(
            prompt=g.prompt.text,
            # An episode is judged on the policy's final turn, not on the tools' output.
            completion=c.episode.answer if c.episode is not None else c.text,
            answer=g.prompt.answer,
            metadata=g.prompt.metadata,
            finish_reason=c.finish_reason,
            num_tokens=len(c.token_ids),
            max_tokens=max_tokens,
            source=g.prompt.source,
            episode=c.episode,
        )
        for g in groups
        for c in g.completions
    ]


class RewardWorker:
    """Scores groups with one :class:`RewardScorer` (every configured reward term)."""

    def __init__(self, scorer: RewardScorer, *, max_tokens: int) -> None:
        self.scorer = scorer
        self.max_tokens = max_tokens

    def score(
        self, groups: list[Group], max_tokens: int | None = None, *, training: bool = True
    ) -> list[Group]:
        """The groups with scores, components and invalid flags (new records; inputs untouched).

        ``training=False`` (evaluation) leaves out the training-only score overrides
        (``rollout.truncated_reward``), so held-out accuracy judges the answer itself."""
        samples = reward_samples(groups, max_tokens or self.max_tokens)
        scored = self.scorer.score(samples, training=training)
        bad = set(scored.invalid_rows)
        out, lo = [], 0
        for g in groups:
            rows = range(lo, lo + g.n)
            out.append(
                replace(
                    g,
                    scores=[scored.scores[r] for r in rows],
                    components={k: [v[r] for r in rows] for k, v in scored.components.items()},
                    invalid=[r in bad for r in rows],
                )
            )
            lo += g.n
        return out

    def verifiable_accuracy(self, groups: list[Group]) -> float | None:
        """Mean of the verifiable-kind components over the groups (NaNs skipped; None if none)."""
        return verifiable_accuracy(self.scorer.terms, (g.components for g in groups))

    def counters(self) -> dict[str, int]:
        return self.scorer.counters()

    def close(self) -> None:
        self.scorer.close()


def _json_value(value: float) -> float | None:
    # JSON has no NaN; a component that did not apply is written as null.
    return value if math.isfinite(value) else None


def sample_record(
    sample: RewardSample, scored: ScoredBatch, i: int, completion: Completion | None = None
) -> dict[str, Any]:
    """The JSON object written for sample ``i`` of a scored batch. A multi-turn episode
    (``completion.episode``) is written whole, with its turns marked: ``completion`` is the
    transcript, ``final_turn`` what the reward judged, ``turns`` each turn's role, text, tool,
    reward and error."""
    record = {
        "prompt": sample.prompt,
        "completion": sample.completion,
        "answer": sample.answer,
        "score": _json_value(scored.scores[i]),
        "components": {name: _json_value(col[i]) for name, col in scored.components.items()},
        "finish_reason": sample.finish_reason,
        "num_tokens": sample.num_tokens,
    }
    episode = completion.episode if completion is not None else None
    if episode is not None:
        record["completion"] = completion.text
        record["final_turn"] = sample.completion
        record["budget"] = episode.budget
        record["turns"] = [
            {"role": t.role, "text": t.text, "tool": t.tool, "reward": t.reward, "error": t.error}
            for t in episode.turns
        ]
    return record


class SampleWriter:
    """Writes ``RUN_DIR/samples/step_N.jsonl`` every ``every`` steps (0: never)."""

    def __init__(self, run_dir: str | Path, every: int, count: int) -> None:
        if every < 0 or count < 1:
            raise ValueError(f"SampleWriter: need every >= 0 and count >= 1, got {every}, {count}")
        self.dir = Path(run_dir) / "samples"
        self.every = every
        self.count = count

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def maybe_write(
        self,
        step: int,
        samples: Sequence[RewardSample],
        scored: ScoredBatch,
        completions: Sequence[Completion] | None = None,
    ) -> Path | None:
        """Write the file for ``step`` if it is due; return its path (None if not due).
        ``completions`` (aligned with ``samples``) add the turns of multi-turn episodes."""
        if not self.due(step):
            return None
        if len(scored.scores) != len(samples):
            raise ValueError(
                f"SampleWriter: {len(samples)} samples but {len(scored.scores)} scores"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step_{step}.jsonl"
        # model text can hold lone surrogates (a token cut inside a character): replaced;
        # renamed into place, so a reader (the report, a tail -f) never sees half a file
        with atomic_write(path, "w", encoding="utf-8", errors="replace") as f:
            for i in range(min(self.count, len(samples))):
                completion = completions[i] if completions is not None else None
                record = sample_record(samples[i], scored, i, completion)
                f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        return path
