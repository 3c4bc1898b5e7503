"""Transport settings every nanoserve gRPC endpoint shares, declared once for both sides."""
import array
import sys
from collections.abc import Iterable

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

# The StepRequest layout both sides speak (worker.proto): a worker reports its own in WorkerInfo, and a
# scheduler refuses a worker of another, whose steps it would misread.
STEP_FORMAT = 2

# StepRequest.token_ids: one little-endian uint32 per token. The scheduler packs with the standard
# library (it has no numpy); a worker reads the bytes as an array without a copy.
_UINT32 = next(code for code in "IL" if array.array(code).itemsize == 4)
TOKEN_ID_DTYPE = "<u4"  # numpy's name of the same layout


def token_array(token_ids: Iterable[int] = ()) -> array.array:
    """Token ids as uint32 in an array: slicing, extending and packing one copies memory, not
    Python ints (a list of 8k ids takes ~100 us to pack, such an array ~2)."""
    return array.array(_UINT32, token_ids)


def pack_token_ids(token_ids: Iterable[int]) -> bytes:
    packed = token_array(token_ids)  # a copy, also of an array: the byte swap below must not touch the caller's
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(data: bytes) -> list[int]:
    """pack_token_ids' inverse, for readers without numpy."""
    unpacked = token_array()
    unpacked.frombytes(data)
    if sys.byteorder != "little":
        unpacked.byteswap()
    return unpacked.tolist()
