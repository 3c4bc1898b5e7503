"""Losing a worker group without losing a request (DESIGN §10).

When any rank fails (its stream breaks, or a step outlives --step-timeout), the engine stops
stepping and hands over to GroupRecovery: the KV of every block is dropped (hashes included), the
running sequences go back to the front of the waiting queue as preempted, and new requests queue
behind them without being admitted. The steps in flight are dropped with their tokens: only
tokens of completed steps were ever delivered, so none is sent twice or lost. Once the group has
shaken hands again (a fresh session, its KV pool allocated anew) the engine resumes and the
sequences recompute prompt plus generated tokens; seeded sampling is keyed by (seed, position),
so they continue with the tokens they would have produced undisturbed. The new group is offered the
failed one's KV pool if that one served: a restarted rank whose configuration is unchanged takes it
instead of measuring its memory again (seconds on a GPU), and the pool keeps its shape.

If no whole group is back within --worker-restart-timeout, the requests end UNAVAILABLE and new
ones are refused until a group returns. So do they when MAX_FAILURES_IN_A_ROW groups in a row fail
before completing a step: workers that fail every step (a bug, a request that crashes them) come
back at once, and recomputing on them would loop forever while the client waits. A group that
answers but can never serve this scheduler (another model, a refused token) ends the engine: the
scheduler exits non-zero so that its own supervisor restarts it against what its workers now are.
"""
import asyncio
import logging
import time
from collections.abc import Callable

from nanoserve.v1 import worker_pb2
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.request_table import RequestTable
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.step_totals import Totals
from scheduler_svc.worker_group import WorkerGroup, WorkerUnavailable

log = logging.getLogger("nanoserve.scheduler")

# Groups failing with no step completed in between before the requests they hold end: a restart
# or two can race a dying peer (tensor parallelism), every step failing is a crash loop.
MAX_FAILURES_IN_A_ROW = 3


class CannotServe(Exception):
    """The workers answer but can never serve this scheduler; waiting will not change it."""


class GroupRecovery:
    """Rebuilds an engine's worker group after a failure, keeping its requests meanwhile."""

    def __init__(self, requests: RequestTable, scheduler: Scheduler, metrics: SchedulerMetrics, totals: Totals,
                 first: worker_pb2.WorkerInfo, restart_timeout: float):
        self.requests = requests
        self.scheduler = scheduler
        self.metrics = metrics
        self.totals = totals
        self.first = first  # what every later group must serve: the same model
        self.restart_timeout = restart_timeout
        # Called once the KV is dropped: KV events say so at once, not once a group is back.
        self.kv_dropped: Callable[[], None] = lambda: None
        self.failures_in_a_row = 0
        self.steps_at_last_failure = -1

    async def recover(self, group: WorkerGroup, reason: str) -> WorkerGroup:
        """The group that serves again, once a whole one does; raises CannotServe when none ever can."""
        requests, scheduler = self.requests, self.scheduler
        started = time.monotonic()
        self.metrics.worker_failure()
        requests.enter_recovery(reason)
        await group.close()
        recompute = sum(seq.num_computed_tokens for seq in scheduler.running)  # KV that is gone
        scheduler.drop_kv(scheduler.num_total_blocks)
        self.kv_dropped()
        for stream in requests.streams.values():
            # Scoring rows of dropped steps never arrived: the recompute asks for them again.
            stream.seq.num_scored_prompt_tokens = len(stream.prompt_logprobs)
        requeued = scheduler.num_waiting
        served = self.totals.prefill_steps + self.totals.decode_steps != self.steps_at_last_failure
        crash_loop = self._count_failure() >= MAX_FAILURES_IN_A_ROW
        if crash_loop:
            self._end_crash_loop(reason)
        else:
            log.error("worker group failed: %s; dropped the KV of %d token(s), holding %d request(s) until a group "
                      "is back (within %.0fs, --worker-restart-timeout)", reason, recompute, requeued,
                      self.restart_timeout)
        group, held = await self._reconnect(group, served, reason,
                                            None if crash_loop else started + self.restart_timeout)
        if not held:
            recompute = 0  # the held requests were ended
        lost = scheduler.drop_kv(group.num_blocks)
        requests.end_requests(lost, f"its sequence no longer fits the restarted workers' KV pool "
                                    f"({group.num_blocks} blocks)")
        self.metrics.group_restored(recompute)
        requests.resume()
        log.info("worker group back after %.2fs (session %s, %d KV blocks): resuming %d request(s), "
                 "recomputing %d token(s)", time.monotonic() - started, group.session_id[:8],
                 group.num_blocks, scheduler.num_waiting, recompute)
        return group

    def _count_failure(self) -> int:
        """Failures in a row of groups that completed no step for the requests they held; a
        failure holding none starts the count over."""
        steps = self.totals.prefill_steps + self.totals.decode_steps
        held = bool(self.requests.streams)
        in_a_row = held and steps == self.steps_at_last_failure
        self.failures_in_a_row = self.failures_in_a_row + 1 if in_a_row else int(held)
        self.steps_at_last_failure = steps
        return self.failures_in_a_row

    def _end_crash_loop(self, reason: str) -> None:
        """Ends the held requests of groups that keep failing before any step completes; the next
        requests get as many tries (a fixed worker may be back by then)."""
        self.failures_in_a_row = 0
        message = (f"the worker group failed {MAX_FAILURES_IN_A_ROW} times in a row without completing a step: "
                   f"its workers fail every step (see their logs); the last failure: {reason}")
        log.error("%s; ending %d request(s)", message, len(self.requests.streams))
        self.requests.give_up(message)

    async def _reconnect(self, failed: WorkerGroup, served: bool, reason: str,
                         deadline: float | None) -> tuple[WorkerGroup, bool]:
        """Connects a fresh group, applying aborts meanwhile (a client's deadline still ends its
        request); past the deadline the held requests end UNAVAILABLE and it goes on waiting.
        With the group, whether the requests are still held: False when it came to that, or
        without a deadline (the requests were ended already)."""
        requests = self.requests
        connecting = asyncio.ensure_future(self._connect(failed, served))
        gave_up = deadline is None
        try:
            while not connecting.done():
                requests.work.clear()
                requests.apply_aborts()
                woken = asyncio.ensure_future(requests.work.wait())
                timeout = None if gave_up else max(0.0, deadline - time.monotonic())
                await asyncio.wait((connecting, woken), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                if not connecting.done() and not gave_up and time.monotonic() >= deadline:
                    gave_up = True
                    message = (f"no worker group came back within {self.restart_timeout:.0f}s "
                               f"(--worker-restart-timeout) after: {reason}")
                    log.error("%s; ending %d request(s)", message, len(requests.streams))
                    requests.give_up(message)
        finally:
            connecting.cancel()
        return connecting.result(), not gave_up

    async def _connect(self, failed: WorkerGroup, served: bool) -> WorkerGroup:
        """A whole group on the failed one's addresses, retried until one connects. The first try
        offers the failed group's KV pool if that group served (it fit); a try that failed may have
        failed for it (the memory it needs is taken), so the later ones let the ranks measure."""
        offer_kv_pool = served
        while True:
            group = failed.renewed(offer_kv_pool)
            offer_kv_pool = False
            try:
                await group.connect(timeout=30)
                self._check_same_model(group)
                return group
            except WorkerUnavailable as err:
                log.warning("worker group not back yet: %s", err)
                self.requests.failure = f"no worker group can serve: {err}"
                await group.close()
                if err.final:
                    raise CannotServe(str(err)) from None
                await asyncio.sleep(1)  # a refusal comes at once: do not spin on it
            except CannotServe:
                await group.close()
                raise

    def _check_same_model(self, group: WorkerGroup) -> None:
        """The restarted group must serve what the scheduler was set up for (tokenizer, limits)."""
        info, first = group.infos[0], self.first
        if (info.model_fingerprint, info.block_size, info.vocab_size) != (first.model_fingerprint, first.block_size,
                                                                          first.vocab_size):
            raise CannotServe(f"the restarted workers serve {info.model!r} (block size {info.block_size}, vocabulary "
                              f"{info.vocab_size}), not the {first.model!r} (block size {first.block_size}, "
                              f"vocabulary {first.vocab_size}) this scheduler was started for")
