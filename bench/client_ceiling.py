"""The benchmark client's own ceiling: how many streamed messages a second bench/serve.py takes from N
client processes, and what each message costs a process in CPU. A paced SSE server stands in for the
gateway: every --step-ms it sends each open stream one completion event of one token, in the gateway's
shape, as a GPU decode step does, so it offers streams / step messages a second. The server runs in
--server-processes processes (one port, SO_REUSEPORT) so that it outpaces the client; where a client
process's `cpu_per_wall` nears 1 and the messages a second fall short of the offer, the client is the
limit, and `messages_per_cpu_second` is its price.

    python3 bench/client_ceiling.py [--streams 512] [--output-len 300] [--step-ms 6] [--client-processes 1 2]
"""
import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from aiohttp import web

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto")]

from nanoserve_cli.launcher import free_port, stop_all  # noqa: E402

MODEL = "paced-sse"
# one token's event, as the gateway streams it (token ids returned: bench/serve.py counts them)
EVENT = ('data: {"id":"cmpl-0f1e2d3c4b5a69788796a5b4c3d2e1f0","object":"text_completion","created":1795787712,'
         f'"model":"{MODEL}","choices":[{{"index":0,"text":" the","logprobs":null,"token_ids":[279],'
         '"finish_reason":null,"stop_reason":null}]}\n\n').encode()
DONE = b"data: [DONE]\n\n"


class Steps:
    """A step that ends every `seconds`: every stream waiting for it then sends its next event."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.ended: asyncio.Future | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.ended = loop.create_future()
            await asyncio.sleep(self.seconds)
            self.ended.set_result(None)

    async def wait(self) -> None:
        await asyncio.shield(self.ended)


async def serve(port: int, step_seconds: float) -> None:
    """One server process on the shared port until killed."""
    steps = Steps(step_seconds)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        tokens = (await request.json())["max_tokens"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(tokens):
            await steps.wait()
            await response.write(EVENT)
        await response.write(DONE)
        return response

    app = web.Application()
    app.add_routes([web.get("/health", lambda _: web.Response()), web.get("/v1/models", models),
                    web.post("/v1/completions", completions)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, reuse_port=True, backlog=4096).start()
    ticking = asyncio.create_task(steps.run())
    print("ready", flush=True)
    await ticking


def run_client(url: str, args: argparse.Namespace, processes: int) -> dict:
    """bench/serve.py's one run against the server from `processes` client processes: its rate's summary."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "serve.json"
        subprocess.run([sys.executable, str(REPO / "bench" / "serve.py"), "--openai", url, "--num-prompts",
                        str(args.streams), "--request-rates", "inf", "--input-len", "100", "1024", "--output-len",
                        str(args.output_len), str(args.output_len), "--warmup", "8", "--client-processes",
                        str(processes), "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["rates"]["inf"]


def host() -> str:
    """The CPU's model name and count: a message's CPU cost depends on the core."""
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} CPUs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=512, help="requests, all at once")
    p.add_argument("--output-len", type=int, default=300, help="events (one token each) per stream")
    p.add_argument("--step-ms", type=float, default=6.0, help="the server's pace: one event per stream a step")
    p.add_argument("--client-processes", type=int, nargs="+", default=[1, 2], help="one run each")
    p.add_argument("--server-processes", type=int, default=4)
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "client_ceiling.json"))
    p.add_argument("--serve-port", type=int, default=0, help=argparse.SUPPRESS)  # a server process's
    args = p.parse_args()
    if args.serve_port:
        asyncio.run(serve(args.serve_port, args.step_ms / 1e3))
        return
    port = free_port()
    servers = [subprocess.Popen([sys.executable, __file__, "--serve-port", str(port), "--step-ms", str(args.step_ms)],
                                stdout=subprocess.PIPE, text=True) for _ in range(args.server_processes)]
    runs = []
    try:
        for server in servers:
            server.stdout.readline()  # "ready"
        print(f"{'clients':>7} {'offered msg/s':>13} {'taken msg/s':>11} {'busiest CPU s/s':>15} {'msg per CPU s':>13}")
        for processes in args.client_processes:
            summary = run_client(f"http://127.0.0.1:{port}", args, processes)
            client = summary["client"]
            run = {"client_processes": processes, "offered_messages_per_s": args.streams / (args.step_ms / 1e3),
                   "messages_per_s": summary["stream_messages"] / summary["seconds"], "completed": summary["completed"],
                   "seconds": summary["seconds"], "ttft_ms": summary["ttft_ms"], "itl_ms": summary["itl_ms"], **client}
            runs.append(run)
            print(f"{processes:>7} {run['offered_messages_per_s']:>13,.0f} {run['messages_per_s']:>11,.0f} "
                  f"{max(client['cpu_per_wall']):>15.2f} {client['messages_per_cpu_second']:>13,.0f}", flush=True)
    finally:
        stop_all(servers)
    report = {"date": datetime.date.today().isoformat(), "host": host(), "command": " ".join(sys.argv),
              "streams": args.streams,
              "output_len": args.output_len, "step_ms": args.step_ms, "server_processes": args.server_processes,
              "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
