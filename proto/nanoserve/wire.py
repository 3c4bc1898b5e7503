"""Transport settings every nanoserve gRPC endpoint shares, declared once for both sides."""

# A prefill step of 16k token ids is ~100 KiB; the limit leaves room for large steps and logprobs.
MAX_MESSAGE_BYTES = 64 << 20

GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]

# Servers own their port alone: without SO_REUSEPORT a second server on a busy port fails to bind
# instead of sharing the port's connections with the first. Keepalive pings, idle streams included,
# notice a peer whose host vanished without closing its connection within ~30 s (a worker then ends
# that scheduler's session).
SERVER_OPTIONS = GRPC_OPTIONS + [("grpc.so_reuseport", 0),
                                 ("grpc.keepalive_time_ms", 20_000),
                                 ("grpc.keepalive_timeout_ms", 10_000),
                                 ("grpc.http2.max_pings_without_data", 0)]

# Worker RPC metadata: the scheduler's session (one per connection of its worker group) and the
# shared secret of --worker-token.
SESSION_KEY = "nanoserve-session"
TOKEN_KEY = "authorization"
TOKEN_SCHEME = "Bearer "
