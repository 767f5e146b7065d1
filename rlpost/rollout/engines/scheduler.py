"""Continuous batching: one thread owns the model; requests join and leave between steps.

Sequences share a left-padded KV batch with per-row position ids; a finished one leaves at
the end of a step and a waiting request is prefilled (once for its ``n`` samples, through the
prefix cache) and joins before the next. Weights change only between steps, and every token
records its policy version.

Not transformers' continuous batching: its logprobs are of the top-k/top-p renormalised
distribution, ``num_return_sequences`` is manager-wide, it has no hook to swap weights between
steps, it shares prefixes by whole pages, and it samples from the process-wide RNG. It has a
paged KV and CUDA graphs; on a GPU the vLLM engine is the fast path.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from rlpost.rollout.engines import prefix_cache as pc
from rlpost.rollout.engines.admission import FairQueue
from rlpost.rollout.engines.prefix_cache import LayerKV, PrefixCache
from rlpost.rollout.engines.protocol import (
    LogitAdjust,
    SamplingParams,
    adjust_logits,
    sample_tokens,
)
from rlpost.train.lm_head import serve_head, serving_precision
from rlpost.types import FinishReason

TRIM_COLUMNS = 16  # drop all-padding KV columns once this many have piled up
# The share of the model's time side work (a teacher's scoring) may take while samples decode.
SIDE_SHARE = 0.5


@dataclass
class GenerationRequest:
    """``n`` samples continuing ``prompt_ids``.

    ``seed`` gives the request its own generator; ``adjust`` applies the OpenAI penalties and
    logit bias; ``on_token(event)`` is called on the scheduler thread for every sampled
    token, and must not block or raise."""

    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    stop_texts: tuple[str, ...] = ()
    top_logprobs: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    adjust: LogitAdjust | None = None
    on_token: Callable[[TokenEvent], None] | None = None


@dataclass
class TokenEvent:
    """One sampled token of sample ``index`` of a request; ``finish`` set on its last token."""

    index: int
    token_id: int
    logprob: float
    version: int
    top: list[tuple[int, float]] | None
    finish: FinishReason | None
    text_end: int | None


@dataclass
class SampleOutput:
    """One finished sample: sampled ids, logprobs and versions; ``text_end``: where a matched
    stop text begins in the decoded text."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    token_versions: list[int]
    text_end: int | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def policy_version(self) -> int | None:
        """Version of the weights that produced the first token (None: aborted before one)."""
        return self.token_versions[0] if self.token_versions else None

    @property
    def versions(self) -> list[int]:
        """Every version that produced a token of this sample, ascending."""
        return sorted(set(self.token_versions))


class Ticket:
    """Handle on a submitted request; ``future`` resolves to its ``n`` outputs in order."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.future: Future[list[SampleOutput]] = Future()
        self.cancelled = False
        self.keep_partial = False
        self.group = -1  # the submission it came with (fair admission)
        self.admitted = 0  # samples that have joined the batch (a large n joins in parts)
        self.dropped = False  # its cancellation has been settled
        self.outputs: list[SampleOutput | None] = [None] * request.n
        self.remaining = request.n
        seed = request.seed if request.seed is not None else request.params.seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)


@dataclass
class _Seq:
    """One sample being decoded; its KV is a row of the batch, minus its last sampled token."""

    ticket: Ticket
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: FinishReason | None = None
    text_end: int | None = None

    @property
    def position(self) -> int:
        """Position id of the next input token (the last sampled one)."""
        return len(self.ticket.request.prompt_ids) + len(self.tokens) - 1


@dataclass
class _SideJob:
    """Model work besides decoding (a scoring pass): ``next(chunks)`` does one bounded piece."""

    chunks: Iterator[None]
    future: Future = field(default_factory=Future)


@dataclass
class _WeightUpdate:
    tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Scheduler:
    """Serves generation requests from one model with continuous batching;
    ``max_request_batch`` caps one submission's share of ``max_batch`` beside others."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        max_batch: int = 64,
        max_request_batch: int | None = None,
        prefix_cache: PrefixCache | None = None,
        seed: int = 0,
        version: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        self.model = serve_head(model).eval()  # the decode step's head on the faster kernel
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_request_batch = max_request_batch or max(2, max_batch // 8)
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache()
        self.generator = torch.Generator().manual_seed(seed)
        self.version = version
        self.eos_id = tokenizer.eos_token_id
        self.max_model_len = max_model_len or getattr(model.config, "max_position_embeddings", None)
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._params.update(dict(model.named_buffers(remove_duplicate=False)))
        self._cond = threading.Condition()
        self._waiting = FairQueue()
        self._weights: deque[_WeightUpdate] = deque()
        self._side: deque[_SideJob] = deque()
        self._side_credit = 0.0  # seconds side work may still take before the next step
        # names a failed update wrote: a mix of versions, so no request is admitted
        self._mixed: set[str] = set()
        self._rows: list[_Seq] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self.counters = dict.fromkeys(
            ("steps", "tokens", "prefills", "requests", "errors", "cancelled", "max_batch_seen"), 0
        )
        self.busy_seconds = 0.0
        self.started = time.monotonic()

    def start(self) -> Scheduler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rlpost-scheduler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request: GenerationRequest) -> Ticket:
        """Queue a request; the ticket's future resolves when all its samples are done."""
        return self.submit_all([request])[0]

    def submit_all(
        self,
        requests: list[GenerationRequest],
        on_done: Callable[[int, Future], None] | None = None,
    ) -> list[Ticket]:
        """Queue requests to join at one step boundary, ``on_done(i, future)`` attached first,
        so the samples drawn do not depend on thread timing."""
        for request in requests:
            if not request.prompt_ids:
                raise ValueError("empty prompt: a request needs at least one prompt token")
            if request.n < 1:
                raise ValueError(f"n={request.n} must be >= 1")
        tickets = [Ticket(r) for r in requests]
        if on_done is not None:
            for i, ticket in enumerate(tickets):
                ticket.future.add_done_callback(lambda f, i=i: on_done(i, f))
        with self._cond:
            if self._stop:  # nothing would ever answer them
                raise RuntimeError("the scheduler stopped; it takes no new requests")
            self._waiting.push(tickets)
            self._cond.notify_all()
        return tickets

    def cancel(self, ticket: Ticket, *, keep_partial: bool = False) -> None:
        """Free the ticket's slots at the next step; with ``keep_partial`` the future resolves
        with every sample so far, unfinished ones marked ``abort``."""
        with self._cond:
            ticket.cancelled, ticket.keep_partial = True, keep_partial
            self._cond.notify_all()

    def run_between_steps(self, chunks: Iterator[None]) -> Future:
        """Run ``chunks`` (a generator of bounded model work) on the scheduler thread between
        decode steps, within :data:`SIDE_SHARE` of the time while samples decode."""
        job = _SideJob(chunks)
        with self._cond:
            if self._stop:
                raise RuntimeError("the scheduler stopped; it takes no new work")
            self._side.append(job)
            self._cond.notify_all()
        return job.future

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        timeout: float | None = None,
        *,
        shapes: dict[str, tuple[int, ...]] | None = None,
    ) -> float:
        """Swap in new weights between two decode steps; returns the seconds it waited.

        Every name, shape and dtype is checked first; with ``shapes`` the tensors stream in
        one at a time, the caller vouching that the stream matches them."""
        tensors = dict(named_tensors) if shapes is None else named_tensors
        if not (shapes if shapes is not None else tensors):  # a version with nothing in it
            raise ValueError(f"weights for version {version}: the update holds no tensor")
        for name, shape in (shapes or {k: t.shape for k, t in tensors.items()}).items():
            target = self._params.get(name)
            if target is None:
                raise KeyError(f"weight {name!r} is not a parameter of the serving model")
            if tuple(target.shape) != tuple(shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(shape)}, the model expects {tuple(target.shape)}"
                )
            tensor = tensors[name] if shapes is None else target  # a stream's dtypes: its decoder's
            if tensor.dtype != target.dtype and not (
                tensor.is_floating_point() and target.is_floating_point()
            ):  # a float tensor is cast to the model's float dtype; nothing else is
                raise ValueError(
                    f"weight {name!r} has dtype {tensor.dtype}, the model expects {target.dtype}"
                )
        update = _WeightUpdate(tensors, version)
        start = time.perf_counter()
        with self._cond:
            if self._stop:
                raise RuntimeError(
                    f"the scheduler stopped; weights for version {version} not applied"
                )
            self._weights.append(update)
            self._cond.notify_all()
        if not update.done.wait(timeout):
            with self._cond:
                queued = update in self._weights
                if queued:  # not started: withdrawn whole, nothing was written
                    self._weights.remove(update)
            if queued:
                raise TimeoutError(
                    f"weights for version {version} were not applied within {timeout} s"
                )
            # started: its tensors (a stream the caller owns) are read until it ends
            update.done.wait()
        if update.error is not None:
            raise update.error
        return time.perf_counter() - start

    def stats(self) -> dict[str, float]:
        with self._cond:
            waiting = self._waiting.sequences()
        return {
            **self.counters,
            "active": len(self._rows),
            "waiting": waiting,
            "weights_mixed": float(len(self._mixed)),  # > 0: serving paused until a full update
            "policy_version": self.version,
            "busy_seconds": self.busy_seconds,
            "uptime_seconds": time.monotonic() - self.started,
        }

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or (self._waiting and not self._mixed) or self._has_work()):
                    self._cond.wait()
                if self._stop:
                    break
                updates = list(self._weights)
                self._weights.clear()
                admitted = self._take_admissible()
            start = time.perf_counter()
            for update in updates:
                self._apply_weights(update)
            if self._mixed and self._rows:  # their KV and their next tokens: mixed weights
                self.counters["errors"] += 1
                self._fail_all([], RuntimeError("the weights being served were updated in part"))
            try:
                self._drop_cancelled()
                self._admit(admitted)
                if self._rows:
                    self._decode_step()
            except Exception as exc:  # a bad request must fail its tickets, not the server
                self.counters["errors"] += 1
                self._fail_all(admitted, exc)
            self._side_turn(time.perf_counter() - start)
            self.busy_seconds += time.perf_counter() - start
        self._fail_all([], RuntimeError("the scheduler stopped"))
        for job in self._side:
            job.future.cancel()
        with self._cond:  # updates queued behind the stop are answered, not left waiting
            left, self._weights = list(self._weights), deque()
        for update in left:
            update.error = RuntimeError(
                f"the scheduler stopped; version {update.version} not applied"
            )
            update.done.set()

    def _has_work(self) -> bool:
        return bool(self._weights or self._rows or self._side)

    def _side_turn(self, step_seconds: float) -> None:
        """One piece of the first side job, when its share of the time allows; jobs take
        turns, and each decode step earns ``SIDE_SHARE`` of its time (one step's worth saved)."""
        if not self._side:
            self._side_credit = 0.0
            return
        if self._rows:
            earned = SIDE_SHARE * step_seconds
            self._side_credit = min(self._side_credit + earned, earned)
            if self._side_credit <= 0:
                return
        with self._cond:
            job = self._side.popleft()
        start = time.perf_counter()
        done = self._side_piece(job)
        if self._rows:
            self._side_credit -= time.perf_counter() - start
        if not done:
            with self._cond:
                self._side.append(job)

    def _side_piece(self, job: _SideJob) -> bool:
        """Run the job's next piece; True when it has ended (finished, failed or cancelled)."""
        if job.future.cancelled():
            job.chunks.close()
            return True
        try:
            next(job.chunks)
        except StopIteration as end:
            with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                job.future.set_result(end.value)
            return True
        except Exception as exc:  # the caller's work failed: its future says so
            with contextlib.suppress(InvalidStateError):
                job.future.set_exception(exc)
            return True
        return False

    def _take_admissible(self) -> list[tuple[Ticket, range]]:
        """``(ticket, samples)`` of waiting tickets that fit, a fair share per submission; none
        while an update is partly applied. The caller holds the lock."""
        if self._mixed:
            return []
        running = Counter(s.ticket.group for s in self._rows)
        room = self.max_batch - len(self._rows)
        return self._waiting.take(room, running, self.max_request_batch, self._finish_cancelled)

    @torch.no_grad()
    def _apply_weights(self, update: _WeightUpdate) -> None:
        written: set[str] = set()
        try:
            items = update.tensors
            for name, tensor in items.items() if isinstance(items, dict) else items:
                param = self._params[name]
                if param.shape != tensor.shape:  # copy_ would broadcast a wrong shape silently
                    raise ValueError(
                        f"weight {name!r} has shape {tuple(tensor.shape)}, not {tuple(param.shape)}"
                    )
                param.copy_(tensor)
                written.add(name)
            self.version = update.version
            self._mixed -= written
        except Exception as exc:  # reported to the caller of load_weights
            update.error = exc
            self._mixed |= written  # nothing new is admitted until an update rewrites these
        if written:
            self.prefix_cache.clear()
        update.done.set()

    def _drop_cancelled(self) -> None:
        # a snapshot: callbacks may cancel more tickets, dropped at the next step
        gone = {id(s): s for s in self._rows if s.ticket.cancelled}
        for s in gone.values():
            if s.ticket.keep_partial:
                s.finish = "abort"
                self._complete(s)
        for ticket in {id(s.ticket): s.ticket for s in gone.values()}.values():
            self._finish_cancelled(ticket)
        if gone:
            self._keep_rows([i for i, s in enumerate(self._rows) if id(s) not in gone])

    def _finish_cancelled(self, ticket: Ticket) -> None:
        if ticket.dropped:  # a ticket that joined in part: its rows and its queued rest
            return
        ticket.dropped = True
        self.counters["cancelled"] += 1
        if not ticket.keep_partial:
            ticket.future.cancel()
        elif not ticket.future.done():  # never admitted: nothing was sampled
            empty = SampleOutput([], [], "abort", [])
            ticket.future.set_result([o or empty for o in ticket.outputs])

    def _fail_all(self, admitted: list[tuple[Ticket, range]], exc: BaseException) -> None:
        tickets = {id(s.ticket): s.ticket for s in self._rows}
        tickets.update({id(t): t for t, _ in admitted})
        if self._stop:
            with self._cond:
                tickets.update({id(t): t for t in self._waiting.clear()})
        for ticket in tickets.values():
            if not ticket.future.done():
                ticket.future.set_exception(exc)
        self._rows, self._cache, self._mask = [], None, None

    @torch.no_grad()
    def _prefill(self, prompt: list[int]) -> tuple[LayerKV, torch.Tensor]:
        """(KV ``[1, H, L, D]`` per layer, next-token logits ``[V]``) of ``prompt``, via the prefix cache."""
        entry = self.prefix_cache.lookup(prompt, self.version)
        if entry is not None and len(entry.tokens) == len(prompt):
            return entry.kv, entry.logits
        start = len(entry.tokens) if entry is not None else 0
        cache = pc.cache_from(entry.kv) if entry is not None else DynamicCache()
        device = next(self.model.parameters()).device
        ids = torch.tensor([prompt[start:]], dtype=torch.long, device=device)
        pos = torch.arange(start, len(prompt), dtype=torch.long, device=device)[None]
        with serving_precision(self.model):
            out = self.model(
                input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1
            )
        kv, logits = pc.cache_tensors(cache), out.logits[0, -1].float()
        self.prefix_cache.insert(prompt, kv, logits, self.version)
        self.counters["prefills"] += 1
        return kv, logits

    def _admit(self, admitted: list[tuple[Ticket, range]]) -> None:
        """Prefill each request once, sample the first tokens, and join the unfinished samples
        to the batch in one copy of the batch KV."""
        kvs, masks = [], []
        if self._rows:
            kvs.append(pc.cache_tensors(self._cache))
            masks.append(self._mask)
        for ticket, samples in admitted:
            request = ticket.request
            kv, logits = self._prefill(request.prompt_ids)
            seqs = [_Seq(ticket, i) for i in samples]
            self._advance(seqs, logits.expand(len(seqs), -1))
            alive = [s for s in seqs if s.finish is None]
            if alive:
                kvs.append(pc.repeat_rows(kv, len(alive)))
                cols = len(request.prompt_ids)
                masks.append(torch.ones(len(alive), cols, dtype=torch.long, device=logits.device))
                self._rows.extend(alive)
        if len(kvs) > (1 if self._cache is not None else 0):
            width = max(m.shape[1] for m in masks)
            self._cache = pc.cache_from(pc.concat_batches([pc.left_pad(kv, width) for kv in kvs]))
            self._mask = torch.cat([pc.pad_mask(m, width) for m in masks])

    @torch.no_grad()
    def _decode_step(self) -> None:
        rows = self._rows
        device = self._mask.device
        ids = torch.tensor([[s.tokens[-1]] for s in rows], dtype=torch.long, device=device)
        pos = torch.tensor([[s.position] for s in rows], dtype=torch.long, device=device)
        self._mask = torch.cat([self._mask, self._mask.new_ones(len(rows), 1)], dim=-1)
        inputs = {"input_ids": ids, "attention_mask": self._mask, "position_ids": pos}
        with serving_precision(self.model):
            out = self.model(**inputs, cache=self._cache, use_cache=True)
        self.counters["steps"] += 1
        self.counters["max_batch_seen"] = max(self.counters["max_batch_seen"], len(rows))
        self._advance(rows, out.logits[:, -1, :])
        if any(s.finish is not None for s in rows):
            self._keep_rows([i for i, s in enumerate(rows) if s.finish is None])

    def _keep_rows(self, keep: list[int]) -> None:
        """Shrink the batch to ``keep`` and drop KV columns that are now padding in every row."""
        if not keep:
            self._rows, self._cache, self._mask = [], None, None
            return
        if len(keep) < len(self._rows):
            self._cache.batch_select_indices(torch.tensor(keep, device=self._mask.device))
            self._mask = self._mask[keep]
            self._rows = [self._rows[i] for i in keep]
        first = int(self._mask.any(dim=0).long().argmax())
        if first >= TRIM_COLUMNS:
            self._cache = pc.cache_from(pc.slice_columns(pc.cache_tensors(self._cache), first))
            self._mask = self._mask[:, first:]

    def _advance(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        """Sample one token per sequence from ``logits`` [len(seqs), V] and record it."""
        adjusts = [s.ticket.request.adjust for s in seqs]
        if any(a is not None and a.active for a in adjusts):
            rows = [
                adjust_logits(logits[i], s.tokens, a) if a is not None and a.active else logits[i]
                for i, (s, a) in enumerate(zip(seqs, adjusts, strict=True))
            ]
            logits = torch.stack([r.float() for r in rows])
        tokens = torch.empty(len(seqs), dtype=torch.long)
        logps = torch.empty(len(seqs))
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(seqs):
            p, gen = s.ticket.request.params, s.ticket.generator or self.generator
            # Rows differing only in max_tokens or stop ids sample in one call.
            groups.setdefault((p.temperature, p.top_p, p.top_k, id(gen)), []).append(i)
        for idx in groups.values():
            ticket = seqs[idx[0]].ticket
            at = torch.tensor(idx)
            tok, lp = sample_tokens(
                logits[at], ticket.request.params, ticket.generator or self.generator
            )
            tokens[at], logps[at] = tok.cpu(), lp.cpu()
        tops = self._top_alternatives(seqs, logits)
        for i, (s, tok, lp) in enumerate(zip(seqs, tokens.tolist(), logps.tolist(), strict=True)):
            s.tokens.append(tok)
            s.logprobs.append(lp)
            s.versions.append(self.version)
            if tops[i] is not None:
                s.tops.append(tops[i])
            self._check_finished(s, tok)
            on_token = s.ticket.request.on_token
            if on_token is not None:  # before the future resolves, so a stream sees every token
                on_token(TokenEvent(s.index, tok, lp, self.version, tops[i], s.finish, s.text_end))
            if s.finish is not None:
                self._complete(s)
        self.counters["tokens"] += len(seqs)

    def _top_alternatives(self, seqs: list[_Seq], logits: torch.Tensor) -> list:
        """The ``top_logprobs`` most likely (id, logprob) of each row that asks, in one topk
        over those rows (a row at a time cost a Python round trip per row and step)."""
        out: list = [None] * len(seqs)
        ks = [s.ticket.request.top_logprobs for s in seqs]
        rows = [i for i, k in enumerate(ks) if k > 0]
        if not rows:
            return out
        temps = [seqs[i].ticket.request.params.temperature or 1.0 for i in rows]
        scaled = logits[rows].float() / torch.tensor(temps, device=logits.device)[:, None]
        values, ids = torch.log_softmax(scaled, dim=-1).topk(max(ks[i] for i in rows), dim=-1)
        for j, (vs, ts) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
            k = ks[rows[j]]
            out[rows[j]] = list(zip(ts[:k], vs[:k], strict=True))
        return out

    def _check_finished(self, s: _Seq, token: int) -> None:
        request = s.ticket.request
        if token in request.params.stop_token_ids or (
            token == self.eos_id and not request.ignore_eos
        ):
            s.finish = "stop"
        elif request.stop_texts and self._stop_text_at(s) is not None:
            s.finish = "stop"
        elif len(s.tokens) >= request.params.max_tokens or (
            self.max_model_len is not None and s.position + 1 >= self.max_model_len
        ):
            s.finish = "length"

    def _stop_text_at(self, s: _Seq) -> int | None:
        text = self.tokenizer.decode(s.tokens, skip_special_tokens=True)
        hits = [text.find(stop) for stop in s.ticket.request.stop_texts if stop and stop in text]
        if hits:
            s.text_end = min(hits)
        return s.text_end

    def _complete(self, s: _Seq) -> None:
        ticket = s.ticket
        tops = s.tops if ticket.request.top_logprobs > 0 else None
        out = SampleOutput(s.tokens, s.logprobs, s.finish, s.versions, s.text_end, tops)
        ticket.outputs[s.index] = out
        ticket.remaining -= 1
        if ticket.remaining == 0 and not ticket.future.done():
            self.counters["requests"] += 1
            ticket.future.set_result(list(ticket.outputs))
