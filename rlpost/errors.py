"""Errors that cross boundaries: a worker's failure as a typed record, the one-line form
of any error, and a model load's refusal of a checkpoint that does not fill its model.

A worker may live in this process, in a child process or in a Ray actor; its failure
reaches the caller pickled. :class:`WorkerError` keeps what the caller acts on as data
(``role``, ``kind``) beside the message, so a fleet re-sends a draining worker's share
and syncs a worker that is behind, and the loop stops for a lost trainer, by the
``kind`` and ``role`` fields and never by reading the message.
"""

from __future__ import annotations

KINDS = ("behind", "draining", "lost", "failed", "timeout")
"""What happened to a worker's call, and so what its caller does about it.

- ``behind``: the worker holds older weights than the caller sent (it refuses to sample
  from them); it is responsive: sync it, then it serves.
- ``draining``: the worker got a preemption notice (SIGTERM) and takes no new calls; the
  call goes to another worker.
- ``lost``: the worker's process or actor is gone (exited, died, its pipe closed).
- ``failed``: the call raised inside a worker that is still there.
- ``timeout``: the worker did not start, or no worker became healthy, within the limit.
"""


class WorkerError(RuntimeError):
    """A worker's failure: ``role`` (trainer, rollout, reward), ``kind`` (one of
    :data:`KINDS`) and a one-line ``message`` naming the worker and the call.

    It pickles with all three (process pipes, Ray's task errors), so the kind chosen
    where the failure happened is the kind the caller reads."""

    def __init__(self, role: str, kind: str, message: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"worker error kind {kind!r}: use one of {', '.join(KINDS)}")
        super().__init__(message)
        self.role, self.kind, self.message = role, kind, message

    def __reduce__(self):
        return (type(self), (self.role, self.kind, self.message))


class ModelLoadError(RuntimeError):
    """A model path (HF directory or GGUF file) that cannot be used, explained in one line."""


def refuse_incomplete(path, info: dict) -> None:
    """A one-line :class:`ModelLoadError` naming the weights the checkpoint at ``path`` lacks
    (transformers would initialise them at random) or holds that the model has no place for
    (dropped), from ``from_pretrained``'s ``output_loading_info``. A tied output head is
    neither: it is the embedding."""

    def some(keys) -> str:
        names = sorted(keys)
        more = f", ... {len(names) - 4} more" if len(names) > 4 else ""
        return f"{len(names)} weight{'s' * (len(names) > 1)} ({', '.join(names[:4])}{more})"

    parts = []
    if info["missing_keys"]:
        parts.append(f"{some(info['missing_keys'])} missing from it would start at random")
    if info["unexpected_keys"]:
        parts.append(f"{some(info['unexpected_keys'])} the model lacks would be dropped")
    if parts:
        raise ModelLoadError(
            f"model.path={str(path)!r}: {'; '.join(parts)}; name a complete checkpoint of the "
            "model its config describes"
        )


def kind_of(exc: BaseException) -> str:
    """The :data:`KINDS` entry of ``exc``: its own for a :class:`WorkerError`, else
    ``failed`` (an in-process worker's plain exception)."""
    return exc.kind if isinstance(exc, WorkerError) else "failed"


def one_line(exc: BaseException | str, *, limit: int | None = None) -> str:
    """The first non-blank line of an error's text (the type's name when it has none),
    cut to ``limit`` characters with ``...`` when longer."""
    text = exc if isinstance(exc, str) else str(exc)
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    line = lines[0] if lines else ("" if isinstance(exc, str) else type(exc).__name__)
    if limit is not None and len(line) > limit:
        line = line[: max(0, limit - 3)] + "..."
    return line


def typed_line(exc: BaseException, *, limit: int | None = None) -> str:
    """``Type: first line`` (the message of an error that crosses a boundary without its
    type; a :class:`WorkerError`'s own message), cut as :func:`one_line` cuts."""
    if isinstance(exc, WorkerError):
        return one_line(exc.message, limit=limit)
    text = one_line(exc)
    line = f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text
    return one_line(line, limit=limit)


def http_error_line(response) -> str:
    """One line saying why an HTTP answer failed: the OpenAI error envelope's message
    (``{"error": {"message": ...}}``, as ``rlpost serve`` answers), else the body's start."""
    try:
        return one_line(str(response.json()["error"]["message"]))
    except (ValueError, KeyError, TypeError):
        return one_line(response.text, limit=200)
