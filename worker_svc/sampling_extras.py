"""What a step's sampling does beyond the sampler's draw: the grammar of a constrained sequence
(grammar_masks.py), the logits processors a sequence's SamplingParams ask for (top_p, top_k, min_p,
penalties, min_tokens, logit_bias) and the log probabilities (logprobs, prompt_logprobs), kept per
slot of the sequence table.

The runner hooks in at three points: the forward pass hands over the hidden states of the
prompt positions a step scores (score_prompts), the sampler draws from process()'s logits under its
grammar masks, and finish() scores the sampled tokens against the raw logits and hands the rows to the reply.
A step whose sequences ask for none of it costs a couple of attribute reads.
"""
from typing import Callable

import numpy as np
import torch

from nanoserve_kernels.token_bitmask import TokenMasks
from nanoserve_model.logits_processors import LogitsProcessors, ProcessorParams
from nanoserve_model.logprobs import ScoredRows, score_tokens
from nanoserve.v1 import llm_pb2, worker_pb2
from worker_svc.grammar_masks import GrammarMasks
from worker_svc.sequence_table import StepWork

# Prompt positions turned into logits at once when scoring a prompt: bounds the memory
# (rows x vocab floats) a long prompt chunk would otherwise need.
PROMPT_SCORING_ROWS = 256


# The SamplingParams fields beyond temperature and seed that the workers act on: the scheduler
# sets only those a request changes (scheduler_svc/step_encoder.py), so a plain request's reset
# has none of them.
_EXTRA_FIELDS = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "min_tokens", "logprobs", "prompt_logprobs")


def asks_for_extras(sampling: llm_pb2.SamplingParams) -> bool:
    """Whether a sequence may need a logits pass or logprobs; False: neither (map, not a
    generator: this runs for every reset entry)."""
    return any(map(sampling.HasField, _EXTRA_FIELDS)) or bool(sampling.logit_bias)


def processor_params(sampling: llm_pb2.SamplingParams, eos_token_ids: tuple[int, ...],
                     vocab_size: int) -> ProcessorParams:
    def value(name: str, default):
        return getattr(sampling, name) if sampling.HasField(name) else default

    banned = (*sampling.stop_token_ids, *(() if sampling.ignore_eos else eos_token_ids))
    top_k = value("top_k", 0)
    return ProcessorParams(
        temperature=value("temperature", 1.0), top_p=value("top_p", 1.0),
        top_k=top_k if 0 < top_k < vocab_size else 0,  # -1, 0 or the whole vocabulary: every token
        min_p=value("min_p", 0.0), repetition_penalty=value("repetition_penalty", 1.0),
        presence_penalty=value("presence_penalty", 0.0), frequency_penalty=value("frequency_penalty", 0.0),
        min_tokens=value("min_tokens", 0), banned_until_min_tokens=tuple(dict.fromkeys(banned)),
        logit_bias=tuple(sorted(sampling.logit_bias.items())))


class StepLogprobs:
    """One step's scored rows (sampled tokens, prompt positions): device tensors until the step's
    work is done, then the reply's LogprobRows. Each row keeps its sequence's N alternatives."""

    def __init__(self, sampled: tuple[ScoredRows, torch.Tensor, np.ndarray] | None,
                 prompt: list[tuple[ScoredRows, torch.Tensor, int]]):
        self.sampled, self.prompt = sampled, prompt

    def copy_home(self) -> None:
        """Queues the copies to host memory (pinned on CUDA) behind the step's work."""
        def home(rows: ScoredRows, token_ids: torch.Tensor) -> tuple:
            return tuple(_to_host(t) for t in (*rows, token_ids))

        self.sampled = self.sampled and (home(*self.sampled[:2]), self.sampled[2])
        self.prompt = [(home(rows, targets), num_top) for rows, targets, num_top in self.prompt]

    def fill(self, reply: worker_pb2.StepResponse) -> None:
        """Writes the rows (copied home, the step's work done) into the reply."""
        if self.sampled:
            _write_rows(reply.sampled_logprobs, *self.sampled)
        for rows, num_top in self.prompt:
            _write_rows(reply.prompt_logprobs, rows, np.full(len(rows[0]), num_top))


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _write_rows(out: worker_pb2.LogprobRows, rows: tuple, num_top: np.ndarray) -> None:
    logprobs, ranks, top_ids, top_logprobs, token_ids = (t.numpy() for t in rows)
    kept = np.arange(top_ids.shape[1])[None, :] < num_top[:, None]  # each row's own N, rows in order
    out.token_ids.extend(token_ids.tolist())
    out.logprobs.extend(logprobs.tolist())
    out.ranks.extend(ranks.tolist())
    out.top_token_ids.extend(top_ids[kept].tolist())
    out.top_logprobs.extend(top_logprobs[kept].tolist())


class SamplingExtras:
    """Per slot: the logits processors' state and the logprobs asked for. Only the sampling rank
    (rank 0, which has the logits) keeps any; every rank scores prompts alike, because turning
    hidden states into logits is a collective with tensor parallelism."""

    def __init__(self, capacity: int, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device,
                 samples: bool, grammar: GrammarMasks | None = None):
        self.samples, self.eos_token_ids = samples, eos_token_ids
        self.grammar = grammar  # on the sampling rank
        self._masked = np.zeros(0, np.int64)  # the current step's constrained rows (positions in _slots)
        self.processors = LogitsProcessors(capacity, vocab_size, device)
        self.num_logprobs = np.full(capacity, -1, np.int64)  # per slot: SamplingParams.logprobs, -1 = none
        self.num_prompt_logprobs = np.zeros(capacity, np.int64)
        self.any_logprobs = False  # some slot ever asked: until then no batch is looked at
        self.prompt_rows: list[tuple[ScoredRows, torch.Tensor, int]] = []  # scored in the current step
        self._slots, self._flags = np.zeros(0, np.int64), 0  # the current step's sampled slots, passes

    def reset(self, work: StepWork) -> None:
        """Takes the sampling params of the step's reset entries (validated by the sequence table)."""
        if not self.samples:
            return
        for slot, extras, num_generated in work.resets:
            if self.grammar is not None:
                history = extras.history_token_ids[:] if extras.grammar else []
                self.grammar.reset(slot, extras.grammar, history[len(history) - num_generated:])
            self._reset_processors(slot, extras, num_generated)
        if self.grammar is not None:
            self.grammar.fill_first_masks()

    def _reset_processors(self, slot: int, extras: worker_pb2.EntryExtras, num_generated: int) -> None:
        sampling = extras.sampling
        if not asks_for_extras(sampling):
            self.processors.clear(slot)
            self.num_logprobs[slot], self.num_prompt_logprobs[slot] = -1, 0
            return
        self.processors.reset(slot, processor_params(sampling, self.eos_token_ids, self.processors.vocab_size),
                              extras.history_token_ids[:], num_generated)
        self.num_logprobs[slot] = sampling.logprobs if sampling.HasField("logprobs") else -1
        self.num_prompt_logprobs[slot] = sampling.prompt_logprobs
        self.any_logprobs |= sampling.HasField("logprobs")

    def heaviest(self, logits: torch.Tensor) -> torch.Tensor:
        """Processes `logits` as the costliest requests would (every pass, top-p over whole sorted
        rows, logprobs) and returns what the sampler would draw from: the worker runs it once to
        measure the memory sampling peaks at before it sizes the KV cache. It leaves its
        parameters in the slots, which a new cache's extras start without."""
        slots = np.arange(len(logits))
        params = ProcessorParams(top_p=0.9, min_p=0.01, repetition_penalty=1.1, presence_penalty=0.1,
                                 frequency_penalty=0.1, min_tokens=1, banned_until_min_tokens=(0,),
                                 logit_bias=((0, 1.0),))
        for slot in slots:
            self.processors.reset(int(slot), params, [0], num_generated=0)
        device_slots = torch.from_numpy(slots).to(logits.device)
        processed = self.processors(logits, slots, device_slots, self.processors.batch_flags(slots))
        score_tokens(logits, processed.argmax(dim=-1), num_top=1)
        return processed

    def score_prompts(self, work: StepWork, hidden: torch.Tensor, compute_logits) -> None:
        """Scores the prompt positions the step asks for (StepWork.scored): their logits, from
        `hidden` (the step's packed final hidden states), against their targets."""
        self.prompt_rows = []
        for index, targets in work.scored:
            first = int(work.num_new[:index].sum())  # the entry's first row of the packed tokens
            target_ids = torch.tensor(targets, dtype=torch.int64).to(hidden.device)
            for start in range(0, len(targets), PROMPT_SCORING_ROWS):
                end = min(start + PROMPT_SCORING_ROWS, len(targets))
                logits = compute_logits(hidden[first + start:first + end])
                if logits is not None:
                    num_top = int(self.num_prompt_logprobs[work.slots[index]])
                    self.prompt_rows.append((score_tokens(logits, target_ids[start:end], num_top),
                                             target_ids[start:end], num_top))

    def process(self, logits: torch.Tensor, work: StepWork,
                device_slots: torch.Tensor) -> tuple[torch.Tensor, TokenMasks | None]:
        """The logits the sampler draws from, processed when a sampled sequence asks for it, and the
        grammar masks of constrained sequences for the sampler's draw; or, when processors or logprobs
        read the logits, no masks: they are applied first, in place (the logprobs then score the
        masked logits, as vLLM's do)."""
        self._flags, self._masked = 0, self._masked[:0]
        if not (self.processors.num_flagged or self.any_logprobs or (self.grammar and self.grammar.num_constrained)):
            if self.grammar is not None:
                self.grammar.unmasked_step()  # a run of masked steps may just have ended
            return logits, None  # no live sequence asks for anything
        self._slots = work.slots[work.sampled]
        self._flags = self.processors.batch_flags(self._slots)
        masks = None
        if self.grammar is not None:
            self._masked = self.grammar.constrained_rows(self._slots)
            if not self._masked.size:
                self.grammar.unmasked_step()
            elif self._flags or self._scores_any(self._slots):
                self.grammar.mask(logits, self._slots, self._masked, device_slots)
            else:
                masks = self.grammar.draw_masks(self._slots, self._masked, device_slots)
        return (self.processors(logits, self._slots, device_slots, self._flags) if self._flags else logits), masks

    def _scores_any(self, slots: np.ndarray) -> bool:
        """Whether the step scores any of its sampled rows (logprobs)."""
        return self.any_logprobs and bool((self.num_logprobs[slots] >= 0).any())

    def finish(self, raw_logits: torch.Tensor | None, tokens: torch.Tensor | None,
               device_slots: torch.Tensor | None) -> StepLogprobs | None:
        """After the draw: counts the sampled tokens for the penalties, scores them if asked; the
        step's logprob rows, or None (also on ranks that do not sample)."""
        sampled = None
        if raw_logits is not None and tokens is not None:
            if self._flags:
                self.processors.observe(tokens, self._slots, device_slots, self._flags)
            sampled = self._score_sampled(raw_logits, tokens)
        if not (sampled or self.prompt_rows):
            return None
        prompt, self.prompt_rows = self.prompt_rows, []
        return StepLogprobs(sampled, prompt)

    def tokens_home(self, tokens: torch.Tensor, event: torch.cuda.Event | None) -> Callable[[], None] | None:
        """The step's sampled tokens, copied home (in host memory once `event` has passed): the
        advance of the grammars of its masked rows by them, for the step's reply to run (None: none)."""
        return self.grammar.observe(tokens, event, self._slots, self._masked) if self._masked.size else None

    def _score_sampled(self, raw_logits: torch.Tensor, tokens: torch.Tensor):
        if not self.any_logprobs:
            return None
        num_top = self.num_logprobs[self._slots]
        rows = np.flatnonzero(num_top >= 0)
        if not rows.size:
            return None
        if rows.size < len(num_top):
            index = torch.from_numpy(rows).to(raw_logits.device)
            raw_logits, tokens = raw_logits[index], tokens[index]
        return score_tokens(raw_logits, tokens, int(num_top[rows].max())), tokens, num_top[rows]
