"""Running the gateway: one uvicorn process, or with --api-server-count N > 1 uvicorn's supervisor
and N processes sharing the port.

One Python event loop turns every streamed gRPC message into a server-sent event; past ~15k
streamed tokens/s that loop is the ceiling, so N processes each run their own loop and scheduler
channel. The supervisor binds the port once and hands the socket to its processes (vLLM's
--api-server-count does the same): each accepts from one queue, an idle loop the soonest, and no
stale server can share the port as it could with SO_REUSEPORT. It replaces a process that dies,
and on SIGINT / SIGTERM stops them all and waits for them.

Each process builds its app with app_from_environment from the flags this process hands down as
their NANOSERVE_* variables. /metrics adds up every process's: prometheus_client's multiprocess
mode, its values in files under PROMETHEUS_MULTIPROC_DIR (http_metrics.py).
"""
import argparse
import contextlib
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator

import uvicorn

from gateway_svc.app import GatewayConfig, create_app
from gateway_svc.http_metrics import HTTPMetrics, MULTIPROC_DIR_ENV
from nanoserve.flags import flags_of, parse
from nanoserve.gc_freeze import freeze_start_up_objects
from nanoserve.lifeline import LAUNCHER_PID_ENV, follow_launcher

_FACTORY = "gateway_svc.serve:app_from_environment"


def log_format(processes: int) -> str:
    """As the other services' lines, with its level; with several processes each line names its process
    (uvicorn's own name theirs in brackets)."""
    return "%(asctime)s %(levelname)s %(name)s " + ("[%(process)d] " if processes > 1 else "") + "%(message)s"


def serve(args: argparse.Namespace) -> None:
    """Serves until SIGINT / SIGTERM (every process stopped by then; drain.py)."""
    # uvicorn raises the signal that stopped it again once stopped, to the handlers it found: a deliberate
    # stop ends here, with status 0 and no KeyboardInterrupt (a Python handler, unlike SIG_IGN, is not
    # inherited by the processes of --api-server-count).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stopped)
    for flag in flags_of("gateway"):  # what each process parses (its own, with one process)
        os.environ[flag.env] = str(getattr(args, flag.dest))
    with _metrics_dir(args.api_server_count):
        if args.api_server_count > 1:  # the processes end with this one (nanoserve.lifeline)
            os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        # The plain asyncio loop: grpc.aio channels are made for it.
        uvicorn.run(_FACTORY, factory=True, workers=args.api_server_count, host=args.host, port=args.port,
                    log_level=args.log_level, loop="asyncio")


def _stopped(signum: int, frame) -> None:
    pass


def app_from_environment() -> HTTPMetrics:
    """The app one process serves, from the gateway's flags and their NANOSERVE_* variables."""
    args = parse("gateway", [], prog="python -m gateway_svc")
    follow_launcher()
    logging.basicConfig(level=args.log_level.upper(), format=log_format(args.api_server_count))
    app = create_app(GatewayConfig(scheduler=args.scheduler, shutdown_timeout=args.shutdown_timeout,
                                   served_model_name=args.served_model_name,
                                   vllm_metric_names=args.vllm_metric_names))
    freeze_start_up_objects()  # the app, FastAPI's and pydantic's machinery: nothing a collection need walk
    return app


@contextlib.contextmanager
def _metrics_dir(processes: int) -> Iterator[None]:
    """With several processes, the folder their metrics live in: PROMETHEUS_MULTIPROC_DIR if set (then
    emptied between runs by whoever set it, as prometheus_client asks), else a fresh one, removed after."""
    if processes == 1 or os.environ.get(MULTIPROC_DIR_ENV):
        yield
        return
    folder = tempfile.mkdtemp(prefix="nanoserve-gateway-metrics-")
    os.environ[MULTIPROC_DIR_ENV] = folder
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)
