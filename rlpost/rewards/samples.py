"""Write scored completions to the run directory so a person can read them.

Reward hacking is found by reading samples, not by reading curves: every
``every`` steps the first ``count`` completions of the batch are written to
``RUN_DIR/samples/step_N.jsonl``, one JSON object per line, with the final score
and every reward component next to the text that earned it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlpost.types import Completion, RewardSample, ScoredBatch


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
        tmp = path.with_suffix(".jsonl.tmp")
        # model text can hold lone surrogates (a token cut inside a character): replaced
        with tmp.open("w", encoding="utf-8", errors="replace") as f:
            for i in range(min(self.count, len(samples))):
                completion = completions[i] if completions is not None else None
                record = sample_record(samples[i], scored, i, completion)
                f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        # Rename so a reader (the report, a tail -f) never sees a half-written file.
        os.replace(tmp, path)
        return path
