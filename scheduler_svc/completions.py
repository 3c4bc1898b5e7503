"""A request's completions as its Generate stream carries them.

n > 1 makes n sequences of one prompt: the first computes the prompt, the others wait for it and
take its blocks from the prefix cache (Scheduler). Each completion turns what its RequestStream
delivers into messages: the text through the incremental detokenizer and, with stop strings,
token by token through StopStrings, so the message that completes a stop string ends at that
token; logprob rows get their tokens' text.
"""
import dataclasses

import xxhash

from nanoserve.v1 import llm_pb2
from scheduler_svc.logprob_rows import ScoredToken
from scheduler_svc.request_stream import RequestStream
from scheduler_svc.sequence import SamplingOptions, Sequence
from scheduler_svc.stop_strings import StopStrings
from scheduler_svc.tokenizer import TextTokenizer

_FINISH = {"stop": llm_pb2.FINISH_REASON_STOP, "length": llm_pb2.FINISH_REASON_LENGTH}


def completion_options(options: SamplingOptions, index: int) -> SamplingOptions:
    """Completion `index`'s options: after the first, prompt logprobs are the first's alone, and
    a seeded request's completions get seeds of their own (derived, so still reproducible)."""
    if index == 0:
        return options
    seed = None if options.seed is None else xxhash.xxh64_intdigest(f"{options.seed}:{index}".encode())
    return dataclasses.replace(options, seed=seed, prompt_logprobs=None)


def completion_sequences(seq_ids: list[int], prompt_ids: list[int], options: SamplingOptions,
                         completions: list[llm_pb2.ResumedCompletion]) -> list[Sequence]:
    """A sequence for each completion to generate, in index order, with the tokens its client has
    already (from a stream that broke; none for a new request). Those tokens are the sequence's
    own, as a preempted sequence's are: the scheduler recomputes them with the prompt and continues
    after them, the seeded sampler keyed on their positions."""
    seqs: list[Sequence] = []
    leader = None
    for seq_id, completion in zip(seq_ids, completions):
        index = completion.index
        seq_options = completion_options(options, index)
        if completion.token_ids:  # its first message carried the prompt's logprobs already
            seq_options = dataclasses.replace(seq_options, prompt_logprobs=None)
        seq = Sequence(seq_id, prompt_ids, seq_options, index, leader)
        for token_id in completion.token_ids:
            seq.append_token(token_id)
        if index == 0:
            leader = seq
        seqs.append(seq)
    return seqs


class ResumeError(Exception):
    """A resumed completion cannot go on (its tokens had ended it, its text is not theirs); the message says why."""


class CompletionOutput:
    """One completion's side of the stream: next_message() turns what arrived into a message."""

    def __init__(self, stream: RequestStream, tokenizer: TextTokenizer, request_id: str, received_text: str = ""):
        self.stream, self.seq, self.tokenizer = stream, stream.seq, tokenizer
        self.request_id = request_id
        self.detokenizer = tokenizer.new_detokenizer()
        options = self.seq.sampling
        self.stops = StopStrings(options.stop, options.include_stop_str_in_output) if options.stop else None
        self.num_sent = 0                    # tokens sent so far
        self.stop_string: str | None = None  # the stop string that ended it
        self.done = False
        self.prompt_logprobs_sent = False
        self.has_extras = (self.seq.index > 0 or options.logprobs is not None
                           or options.prompt_logprobs is not None)
        self.owed_text = ""  # a resumed completion's text its client has not had yet
        if self.seq.completion_token_ids:
            self._replay(list(self.seq.completion_token_ids), received_text)

    def _replay(self, received: list[int], received_text: str) -> None:
        """A resumed completion's tokens, which its client has with `received_text`: through the
        detokenizer (and stop strings) token by token, unsent, so that what the broken stream held
        back (a stop string that may still complete, an unfinished character) comes out here, first.
        ResumeError if they had ended it with a stop string, or decode to other text."""
        if self.stops is None:
            text = "".join(self.detokenizer.push([token_id]) for token_id in received)
        else:
            _, text = self._through_stop_strings(received, finished=False)
            if self.stop_string is not None:
                raise ResumeError(f"resume: completion {self.seq.index} had finished: its tokens complete the stop "
                                  f"string {self.stop_string!r}; leave finished completions out")
        if not text.startswith(received_text):
            raise ResumeError(f"resume: completion {self.seq.index}'s text is not what its tokens decode to: send the "
                              "text its messages carried, unchanged")
        self.owed_text = text[len(received_text):]
        self.num_sent = len(received)

    def next_message(self) -> llm_pb2.GenerateResponse | None:
        """The message with everything delivered since the last one (None when nothing was);
        the last one, with the finish reason and usage, once the completion is done. A completion
        without stop strings, logprobs or an index pays for none of them (this runs for every
        streamed message)."""
        stream = self.stream
        finished = stream.finished  # read before taking: the final token may land meanwhile
        tokens = stream.take()
        if self.stops is None:
            text = self.detokenizer.push(tokens)
            if finished:
                text += self.detokenizer.flush()
        else:
            tokens, text = self._through_stop_strings(tokens, finished)
            finished = finished or self.stop_string is not None
        self.done = finished
        if self.owed_text:
            text, self.owed_text = self.owed_text + text, ""
        if not tokens and not finished:
            return None
        self.num_sent += len(tokens)
        stream.timer.received(tokens)
        message = llm_pb2.GenerateResponse(request_id=self.request_id, token_ids=tokens, text=text)
        if self.has_extras:
            self._add_extras(message, len(tokens))
        if finished:
            self._finish(message)
        return message

    def _add_extras(self, message: llm_pb2.GenerateResponse, num_tokens: int) -> None:
        """The completion's index, its tokens' logprob rows and, once, the prompt's."""
        message.index = self.seq.index
        logprobs = self.stream.take_logprobs()
        if logprobs:
            message.logprobs.extend(self._token_logprob(row) for row in logprobs[:num_tokens])
        if not self.prompt_logprobs_sent and self.stream.prompt_logprobs:
            message.prompt_logprobs.extend(self._token_logprob(row) for row in self.stream.prompt_logprobs)
            self.prompt_logprobs_sent = True

    def _through_stop_strings(self, tokens: list[int], finished: bool) -> tuple[list[int], str]:
        """Token by token, so that a match ends the tokens at the one completing it."""
        text = []
        min_tokens = self.seq.sampling.min_tokens
        for count, token_id in enumerate(tokens, start=1):
            piece = self.detokenizer.push([token_id])
            if finished and count == len(tokens):
                piece += self.detokenizer.flush()
            out, self.stop_string = self.stops.push(piece, armed=self.num_sent + count >= min_tokens)
            text.append(out)
            if self.stop_string is not None:
                return tokens[:count], "".join(text)
        if finished:
            text.append(self.stops.flush())
        return tokens, "".join(text)

    def _finish(self, message: llm_pb2.GenerateResponse) -> None:
        seq = self.seq
        if self.stop_string is not None:
            message.finish_reason = llm_pb2.FINISH_REASON_STOP
            message.stop_string = self.stop_string
        else:
            message.finish_reason = _FINISH[seq.finish_reason]
            if seq.stop_reason is not None:
                message.stop_token_id = seq.stop_reason
        message.usage.CopyFrom(llm_pb2.Usage(prompt_tokens=seq.num_prompt_tokens, completion_tokens=self.num_sent,
                                             cached_prompt_tokens=seq.num_cached_prompt_tokens))

    def _token_logprob(self, row: ScoredToken) -> llm_pb2.TokenLogprob:
        def logprob(token_id: int, value: float, rank: int) -> llm_pb2.Logprob:
            return llm_pb2.Logprob(token_id=token_id, text=self.tokenizer.token_text(token_id), logprob=value,
                                   rank=rank)

        return llm_pb2.TokenLogprob(token=logprob(row.token_id, row.logprob, row.rank),
                                    top=[logprob(t, value, rank) for rank, (t, value) in enumerate(row.top, 1)])
