"""Transport settings every nanoserve gRPC endpoint shares, declared once for both sides."""

# A prefill step of 16k token ids is ~100 KiB; the limit leaves room for large steps and logprobs.
MAX_MESSAGE_BYTES = 64 << 20

GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]

