"""`python -m gateway_svc --scheduler HOST:PORT --port 8000`: serves the OpenAI HTTP API.

Every flag falls back to an environment variable NANOSERVE_<FLAG>, as the other services' do.
"""
import argparse
import os
import sys

import uvicorn

from gateway_svc.app import GatewayConfig, create_app

DEFAULT_PORT = 8000


def _env(flag: str, default):
    raw = os.environ.get("NANOSERVE_" + flag.upper().replace("-", "_"))
    return default if raw is None else type(default)(raw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gateway_svc", description="OpenAI-compatible HTTP gateway")
    for flag, default, help in [
        ("scheduler", "127.0.0.1:50051", "host:port of the scheduler's gRPC API"),
        ("host", "0.0.0.0", "address to listen on"),
        ("port", DEFAULT_PORT, "HTTP port"),
        ("served-model-name", "", "model id in the API; default: the model directory's name"),
        ("log-level", "info", "uvicorn's log level: critical, error, warning, info, debug"),
    ]:
        value = _env(flag, default)
        p.add_argument("--" + flag, type=type(default), default=value, help=f"{help} (default: {value!r})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    app = create_app(GatewayConfig(scheduler=args.scheduler, served_model_name=args.served_model_name))
    # The plain asyncio loop: grpc.aio channels are made for it.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, loop="asyncio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
