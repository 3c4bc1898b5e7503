"""Builds worker StepRequests by hand, the way the scheduler would: a sequence's first entry
resets it with its whole block table, later entries carry only the blocks it has grown into."""
import math

from nanoserve.step_rows import StepEntry, pack_step
from nanoserve.v1 import llm_pb2, worker_pb2
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner


def cpu_runner(model_dir, block_size: int = 4, num_blocks: int = 512, **config) -> ModelRunner:
    """A float32 CPU runner with its KV cache allocated."""
    config = {"dtype": "float32", **config}
    runner = ModelRunner(WorkerConfig(model=str(model_dir), device="cpu",
                                      block_size=block_size, num_kv_blocks=num_blocks, **config))
    runner.allocate_kv_cache(num_blocks)
    return runner


class StepWriter:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}
        self.next_block = 0
        self.next_step = 0

    def entry(self, seq_id: int, token_ids: list[int], num_computed: int = 0, *, reset: bool = False,
              sample: bool = True, temperature: float = 0.0, seed: int | None = None,
              num_generated: int = 0, shared_blocks: tuple[int, ...] = ()) -> StepEntry:
        """One sequence's entry; fresh blocks are handed out as its context grows. On reset the
        table starts from `shared_blocks` (prefix-cache hits owned by another sequence)."""
        if reset:
            self.tables[seq_id] = list(shared_blocks)
        table = self.tables[seq_id]
        needed = math.ceil((num_computed + max(1, len(token_ids))) / self.block_size) - len(table)
        new_blocks = list(range(self.next_block, self.next_block + max(0, needed)))
        self.next_block += len(new_blocks)
        table += new_blocks
        return StepEntry(seq_id, token_ids, num_computed, sample, num_generated, reset,
                         llm_pb2.SamplingParams(temperature=temperature, seed=seed) if reset else None,
                         list(table) if reset else new_blocks)

    def request(self, *entries: StepEntry, forget: tuple[int, ...] = ()) -> worker_pb2.StepRequest:
        self.next_step += 1
        return pack_step(self.next_step, entries, forget)


def generate(runner: ModelRunner, writer: StepWriter, prompts: dict[int, list[int]], num_tokens: int,
             sampling: dict[int, dict] | None = None, pipelined: bool = False) -> dict[int, list[int]]:
    """Prefills every prompt in one step, decodes them together to `num_tokens` tokens each, then
    tells the runner to forget them. `sampling` maps a seq id to entry() keyword arguments.
    `pipelined` drives it as the scheduler does: each decode is launched before the previous
    step's tokens are read, and sends no token (the runner feeds in the one it sampled)."""
    sampling = sampling or {}
    request = writer.request(*(writer.entry(seq_id, prompt, reset=True, **sampling.get(seq_id, {}))
                               for seq_id, prompt in prompts.items()))
    launched, replies = runner.launch(request), []
    out = {seq_id: [] for seq_id in prompts}
    for index in range(num_tokens - 1):
        if not pipelined:
            replies.append(launched.reply(request.step_id))
            for seq_id, token in zip(prompts, replies[-1].token_ids):
                out[seq_id].append(token)
        entries = [writer.entry(seq_id, [] if pipelined else out[seq_id][-1:], len(prompts[seq_id]) + index,
                                num_generated=index + 1) for seq_id in prompts]
        request = writer.request(*entries)
        following = runner.launch(request)
        if pipelined:
            replies.append(launched.reply(request.step_id - 1))
            for seq_id, token in zip(prompts, replies[-1].token_ids):
                out[seq_id].append(token)
        launched = following
    for seq_id, token in zip(prompts, launched.reply(request.step_id).token_ids):
        out[seq_id].append(token)
    runner.step(writer.request(forget=tuple(prompts)))
    return out
