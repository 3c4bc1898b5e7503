"""nanoserve's contract: the gRPC stubs (nanoserve.v1), the flag table, wire settings, and a small
Python client. Installable alone (proto/pyproject.toml: grpcio and protobuf, no server code)."""

__version__ = "0.1.0"
