"""Per-message CPU cost of the scheduler's Generate handler: the real handler, a fake engine that
delivers one token to each of 256 streams per round, a context whose write() only collects.

    .venv/bin/python bench/handler_overhead.py [REPO]   (REPO: another checkout to compare; default this one)
"""
import asyncio, sys, time, statistics
from pathlib import Path
REPO = Path(sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else Path(__file__).parent.parent).resolve()
sys.path[:0] = [str(REPO), str(REPO / "proto")]
from nanoserve.v1 import llm_pb2
from nanoserve_cli.cache import cache_dir
from scheduler_svc import server as srv
from scheduler_svc.request_stream import RequestStream
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.tokenizer import TextTokenizer

class FakeScheduler:
    num_waiting = 0

class FakeRequests:
    accepts_requests = True
    def abort(self, seq_id): pass

class FakeEngine:
    def __init__(self):
        self.scheduler, self.metrics, self.streams, self.next = FakeScheduler(), SchedulerMetrics(), [], 0
        self.requests = FakeRequests()
    def new_seq_id(self):
        self.next += 1
        return self.next
    def submit(self, seq, wakeup=None):
        s = RequestStream(seq) if wakeup is None else RequestStream(seq, wakeup=wakeup)
        self.streams.append(s)
        return s
    def stop(self, seq): seq.finish_reason = "stop"

def main():
    stop = "--stop" in sys.argv
    tok = TextTokenizer(cache_dir() / "tokenizer-qwen3")
    service = srv.LLMService(max_waiting=10**6)
    service.tokenizer, service.engine = tok, FakeEngine()
    service.info = llm_pb2.ModelInfo(vocab_size=151936, max_model_len=4096)
    if hasattr(srv, "RequestLimits"):
        service.limits = srv.RequestLimits(151936, 4096, 16, 20)
    sampling = llm_pb2.SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=3000)
    if stop:
        sampling.stop.append("never-appears-here")
    num_req, num_tok = 256, 200
    async def run():
        import inspect
        written = []
        class Ctx:
            async def abort(self, code, msg): raise RuntimeError(msg)
            async def write(self, message): written.append(message)
        async def handle(req):
            ctx = Ctx()
            if inspect.isasyncgenfunction(service.Generate):  # what grpc does with a generator handler
                async for m in service.Generate(req, ctx):
                    await ctx.write(m)
            else:
                await service.Generate(req, ctx)
        tasks = []
        for i in range(num_req):
            req = llm_pb2.GenerateRequest(token_ids=llm_pb2.TokenIds(ids=list(range(100, 200))), sampling=sampling)
            tasks.append(asyncio.ensure_future(handle(req)))
        await asyncio.sleep(0)
        streams = service.engine.streams
        assert len(streams) == num_req
        times = []
        for t in range(num_tok):
            tokid = 1000 + (t * 7) % 5000
            written.clear()
            start = time.perf_counter()
            for s in streams:
                s.new_tokens.append(tokid)
                s.seq.completion_token_ids.append(tokid)
                if t == num_tok - 1:
                    s.finished, s.seq.finish_reason = True, "length"
                s.wakeup.set()
            while len(written) < num_req:
                await asyncio.sleep(0)
            times.append((time.perf_counter() - start) / num_req)
        await asyncio.gather(*tasks)
        return times
    times = asyncio.run(run())
    print(f"{REPO.name}{' stop' if stop else ''}: per message us: median {statistics.median(times)*1e6:.2f} "
          f"p10 {sorted(times)[len(times)//10]*1e6:.2f} mean {statistics.fmean(times)*1e6:.2f}")

main()
