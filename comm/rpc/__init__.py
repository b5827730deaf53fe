"""The one request/reply layer: envelopes, tensor framing, a service host, its clients and a mailbox."""

from comm.rpc.client import RpcClient
from comm.rpc.envelope import Empty, ErrorBody, Name, ReplyEnvelope, RequestEnvelope, TensorSpec
from comm.rpc.framing import (
    NamedTensors,
    RpcError,
    decode_tensors,
    encode_tensors,
    error_frames,
    open_reply,
    read_reply,
    reply_frames,
    request_frames,
)
from comm.rpc.host import ServiceHost
from comm.rpc.mailbox import Mailbox
from comm.rpc.pipeline import PipelinedCall, PipelinedConnection, run_calls
from comm.rpc.service import (
    CONTROL,
    Authorizer,
    Call,
    Handler,
    Method,
    OnTimeout,
    Peer,
    ServiceBase,
    allow_all,
    callable_by,
)

__all__ = [
    "CONTROL",
    "Authorizer",
    "Call",
    "Empty",
    "ErrorBody",
    "Handler",
    "Mailbox",
    "Method",
    "Name",
    "NamedTensors",
    "OnTimeout",
    "Peer",
    "PipelinedCall",
    "PipelinedConnection",
    "ReplyEnvelope",
    "RequestEnvelope",
    "RpcClient",
    "RpcError",
    "ServiceBase",
    "ServiceHost",
    "TensorSpec",
    "allow_all",
    "callable_by",
    "decode_tensors",
    "encode_tensors",
    "error_frames",
    "open_reply",
    "read_reply",
    "reply_frames",
    "request_frames",
    "run_calls",
]
