"""The CLI's client side: `nanoserve info`, `stats` and `tokenize`, and what every client command
shares: the connection (--address, TLS) and one line for any failure, never a traceback."""
import argparse
import json
import sys
import urllib.request

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from nanoserve.client import Client, with_default_port
from nanoserve.flags import GATEWAY_TITLE, SCHEDULER_PORT
from nanoserve.healthcheck import serving_status
from nanoserve.tls import tls_files
from nanoserve.v1 import worker_pb2

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# Protobuf's JSON mapping writes 64-bit integers as strings (JavaScript's numbers end at 2**53); the
# CLI prints counters for people and `jq`, as numbers.
_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def open_client(args: argparse.Namespace) -> Client:
    return Client(args.address, tls_files(args))


def rpc_error_line(err: grpc.RpcError, args: argparse.Namespace) -> str:
    """The one line a failed call prints; a worker's port and the gateway's are named as such."""
    if err.code() == grpc.StatusCode.UNIMPLEMENTED and _is_worker(args):
        return (f"error: {args.address} is a nanoserve worker (the internal Worker API), not the public API: "
                f"point --address at the scheduler (port {SCHEDULER_PORT} unless it was given another)")
    # gRPC's own words when an HTTP/1 server answers: "Trying to connect an http1.x server"
    if err.code() == grpc.StatusCode.UNAVAILABLE and "http1.x server" in (err.details() or "") and _is_gateway(args):
        return (f"error: {args.address} is the OpenAI HTTP gateway (http://{args.address}/v1), not the gRPC API: "
                f"point --address at the scheduler (port {SCHEDULER_PORT} unless it was given another)")
    return f"error: {err.code().name}: {err.details()}"


def _is_worker(args: argparse.Namespace) -> bool:
    """Workers report their service by name in grpc.health.v1."""
    try:
        serving_status(args.address, WORKER_SERVICE, timeout=2, tls=tls_files(args))
        return True
    except grpc.RpcError:
        return False


def _is_gateway(args: argparse.Namespace) -> bool:
    """The gateway's OpenAPI description carries its title."""
    try:
        with urllib.request.urlopen(f"http://{with_default_port(args.address)}/openapi.json", timeout=2) as reply:
            return json.load(reply).get("info", {}).get("title") == GATEWAY_TITLE
    except (OSError, ValueError, AttributeError):
        return False


def print_info(client: Client, args: argparse.Namespace) -> None:
    _print_json(client.model_info())


def print_stats(client: Client, args: argparse.Namespace) -> None:
    _print_json(client.stats())


def print_tokens(client: Client, args: argparse.Namespace) -> None:
    print(json.dumps(client.tokenize(args.text)))


def _print_json(message: Message) -> None:
    print(json.dumps(as_dict(message), indent=2))


def as_dict(message: Message) -> dict:
    """The message as JSON would carry it (field names as in the .proto, every field shown), with its
    64-bit integers as numbers. ModelInfo and Stats are flat: only their own fields are looked at."""
    fields = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for field in message.DESCRIPTOR.fields:
        if field.type in _INT64 and field.name in fields:
            value = fields[field.name]
            fields[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
    return fields


QUERIES = {"info": print_info, "stats": print_stats, "tokenize": print_tokens}


def run_query(args: argparse.Namespace) -> int:
    """Runs `info`, `stats` or `tokenize`: 0, or 1 with one line on stderr."""
    try:
        with open_client(args) as client:
            QUERIES[args.command](client, args)
    except grpc.RpcError as err:
        print(rpc_error_line(err, args), file=sys.stderr)
        return 1
    return 0
