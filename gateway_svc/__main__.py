"""`python -m gateway_svc`: the OpenAI HTTP API in front of a scheduler, configured by the `gateway`
flags of the contract's table (`nanoserve gateway` runs this)."""
import logging
import sys

import uvicorn

from gateway_svc.app import GatewayConfig, create_app
from nanoserve.flags import parse
from nanoserve.gc_freeze import freeze_start_up_objects
from nanoserve.lifeline import follow_launcher


def main(argv: list[str] | None = None) -> int:
    args = parse("gateway", argv, prog="python -m gateway_svc")
    follow_launcher()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    app = create_app(GatewayConfig(scheduler=args.scheduler, served_model_name=args.served_model_name))
    freeze_start_up_objects()  # the app, FastAPI's and pydantic's machinery: nothing a collection need walk
    # The plain asyncio loop: grpc.aio channels are made for it.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, loop="asyncio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
