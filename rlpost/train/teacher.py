"""The distillation teacher: scores the student's own sampled tokens.

Two workers with one narrow, picklable interface (:class:`TeacherAPI`), so ``cluster``
can host either in this process, another process or a Ray actor, as the reward model:

- :class:`LocalTeacher`: a local checkpoint directory run in-process. It gives the
  logprob of each sampled token (``logprobs``) and, for a loss over the whole
  vocabulary (``gkd``), the logits at each response position (``logits``).
- :class:`ServerTeacher`: an ``rlpost serve`` (or any server with the same
  ``/v1/prompt_logprobs`` and ``/v1/tokenizer`` routes, :mod:`rlpost.rollout.serve.score_routes`)
  that returns the logprobs of given token ids. It has no ``logits``: the whole
  distribution of every position would not cross HTTP at a useful cost.

The teacher must read token ids as the student does: each worker compares its
tokenizer's :func:`~rlpost.models.vocab.vocab_digest` with the student's when built and
refuses a mismatch in one line. Both score at temperature 1 on the batch's own ids.
"""

from __future__ import annotations

from typing import Protocol

import torch

from rlpost.errors import http_error_line
from rlpost.models.loading import ModelLoadError
from rlpost.models.vocab import vocab_digest, vocab_mismatch
from rlpost.train.batch import TrainBatch, compute_logprobs, model_device, response_logits


class TeacherError(ModelLoadError):
    """A teacher that cannot be used (missing, another tokenizer, a server that refuses);
    the CLI prints it as one line, as a policy that cannot be loaded."""


class TeacherAPI(Protocol):
    """What the train stage asks of a teacher; arguments and results are picklable."""

    def logprobs(self, batch: TrainBatch) -> torch.Tensor: ...  # [B, T] float32
    def close(self) -> None: ...


def check_local_teacher(path: str, student: dict) -> None:
    """Raise :class:`TeacherError` unless ``path`` is a model (an HF directory or a GGUF file)
    whose tokenizer is the student's (``student``: its vocab digest); no weights are read."""
    from rlpost.models.loading import check_model_path, load_tokenizer

    try:
        check_model_path(path)
        problem = vocab_mismatch(student, vocab_digest(load_tokenizer(path)))
    except ModelLoadError as exc:
        raise TeacherError(f"model.teacher.path={path}: {exc}") from None
    if problem is not None:
        raise TeacherError(
            f"model.teacher.path={path}: {problem}; distil from a "
            "teacher with the student's tokenizer"
        )


class LocalTeacher:
    """A causal LM loaded from ``path``, frozen, scoring batches in micro-batches."""

    def __init__(self, path: str, student: dict, micro_batch_size: int = 64) -> None:
        from rlpost.models.loading import load_causal_lm

        check_local_teacher(path, student)  # the tokenizers, before the weights load
        try:
            self.model = load_causal_lm(path, dtype="float32")
        except ModelLoadError as exc:
            raise TeacherError(f"model.teacher.path={path}: {exc}") from None
        self.model.eval().requires_grad_(False)
        self.micro_batch_size = micro_batch_size

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` the teacher's logprob of each response token (0 on padding)."""
        T = batch.responses.shape[1]
        real = batch.attention_mask[:, -T:] > 0
        lp = compute_logprobs(  # no gradient
            self.model,
            batch.to(model_device(self.model)),
            temperature=1.0,
            micro_batch_size=self.micro_batch_size,
        ).cpu()
        return torch.where(real, lp, torch.zeros_like(lp))

    @torch.no_grad()
    def logits(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T, V]`` float32 logits predicting each response token (a GKD loss's input)."""
        on = batch.to(model_device(self.model))
        rows = torch.arange(len(on))
        parts = [
            response_logits(self.model, on.select(chunk)).float().cpu()
            for chunk in rows.split(self.micro_batch_size)
        ]
        return torch.cat(parts)

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]


class ServerTeacher:
    """A server answering ``POST /v1/prompt_logprobs`` for the student's token ids."""

    def __init__(
        self,
        url: str,
        student: dict,
        *,
        api_key: str | None = None,
        timeout: float = 120.0,
    ) -> None:
        import httpx

        self.url = url.rstrip("/")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)
        served = self._call("GET", "/v1/tokenizer")
        problem = vocab_mismatch(student, served)
        if problem is not None:
            raise TeacherError(
                f"model.teacher.url={url}: {problem}; serve a teacher with the student's tokenizer"
            )

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        import httpx

        try:
            r = self.http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise TeacherError(
                f"model.teacher.url={self.url}: {type(exc).__name__}: {exc}"
            ) from None
        if r.status_code != 200:
            raise TeacherError(
                f"model.teacher.url={self.url}: {path} answered {r.status_code}: "
                f"{http_error_line(r)}"
            )
        return r.json()

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` the served model's logprob of each response token (0 on padding)."""
        prompt_lens, response_lens = batch.lengths()
        seqs = [
            row[m > 0].tolist()
            for row, m in zip(batch.input_ids, batch.attention_mask, strict=True)
        ]
        keep = [i for i in range(len(batch)) if int(response_lens[i]) > 0]
        out = torch.zeros(batch.responses.shape, dtype=torch.float32)
        if not keep:
            return out
        body = {"prompts": [seqs[i] for i in keep], "starts": [int(prompt_lens[i]) for i in keep]}
        rows = self._call("POST", "/v1/prompt_logprobs", body)["logprobs"]
        for i, lp in zip(keep, rows, strict=True):
            if len(lp) != int(response_lens[i]):
                raise TeacherError(
                    f"model.teacher.url={self.url}: {len(lp)} logprobs for a "
                    f"{int(response_lens[i])}-token response"
                )
            out[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        return out

    def close(self) -> None:
        self.http.close()


def build_teacher(
    path: str | None,
    url: str | None,
    student_tokenizer,
    *,
    api_key: str | None = None,
    timeout: float = 120.0,
    micro_batch_size: int = 64,
) -> LocalTeacher | ServerTeacher:
    """The teacher ``path`` (a local checkpoint) or ``url`` (a server) names, checked against
    the student's tokenizer."""
    student = vocab_digest(student_tokenizer)
    if path:
        return LocalTeacher(path, student, micro_batch_size)
    if url:
        return ServerTeacher(url, student, api_key=api_key, timeout=timeout)
    raise TeacherError("model.teacher: neither path nor url is set; name the teacher")


def check_teacher(
    path: str | None,
    url: str | None,
    student_tokenizer,
    *,
    api_key: str | None = None,
    timeout: float = 120.0,
) -> None:
    """Raise :class:`TeacherError` for a teacher ``build_teacher`` would refuse, reading only
    tokenizers (a run checks this before its directory is touched)."""
    student = vocab_digest(student_tokenizer)
    if path:
        check_local_teacher(path, student)
    elif url:
        ServerTeacher(url, student, api_key=api_key, timeout=timeout).close()
    else:
        raise TeacherError("model.teacher: neither path nor url is set; name the teacher")
