"""What a stopping nanoserve server tells its clients (the scheduler over gRPC, the gateway over HTTP),
worded alike so that a router or a person tells a deliberate stop from a failure.

While it drains, new requests are refused with DRAINING (gRPC UNAVAILABLE, HTTP 503: a router retries
them on another replica); requests still running when --shutdown-timeout has passed end with
SHUTTING_DOWN.
"""
DRAINING = "the server is draining before it shuts down and takes no new requests: retry on another replica"
SHUTTING_DOWN = "the server is shutting down"
