"""The frames a fuzzer throws at a running job: random, mutated, and every one of them invalid.

Three kinds, one per kind of port:

* control frames (:meth:`FrameMaker.control`), for a ROUTER of the RPC layer (a worker's
  service host, the embedded registry): random bytes, msgpack that is no envelope, and above
  all real request envelopes of every method a job serves, whose body is a real message of
  ``services/protocol/`` or ``comm/registry/protocol.py`` broken by one or more mutations
  (wrong fields, wrong types, wrong versions, huge sizes, truncated tensors);
* data frames (:meth:`FrameMaker.data`), for a PULL socket of the zmq transport: tensor
  headers (``comm/wire.py``) broken the same way, with their bodies;
* door requests (:meth:`FrameMaker.door`), for a rank's door (``comm/zmq/door.py``): random
  bytes, and channel requests with a defect (an unknown field, a wrong version or type, a field
  missing, a second frame);
* raw TCP bytes (:meth:`FrameMaker.raw_tcp`): not even ZeroMQ's greeting.

A fuzzer that holds the job's keys may still send nothing that does work: a frame that
validated would act on the running job (release its stage, zero its gradients), and the
test compares the job's parameters with one process's. So every mutated frame carries at
least one *certain* defect (an unknown field: every message forbids extras; a protocol
version that is not this one; tensor frames that do not fit their specs; a header that
claims another source), and ``test_frames.py`` proves the exact stream a seed produces is
refused by the real validators.
"""

from __future__ import annotations

import inspect
import random
import typing
from collections.abc import Callable
from typing import Any

import msgpack
from pydantic import BaseModel

from comm.codec import PROTOCOL_VERSION, Message
from comm.registry import protocol as registry_protocol
from comm.registry.server import RegistryService
from comm.rpc.envelope import Empty
from comm.sockets import CONTROL_MAX_MESSAGE
from comm.wire import DTYPES, MAX_NDIM, MAX_TENSOR_BYTES
from comm.zmq import shm
from services import protocol
from services.barrier import BarrierService
from services.compute.service import CellComputeService
from services.host.worker import _Control
from services.params.server import ParamServerService

__all__ = ["SEEDS", "SERVICE_METHODS", "FrameMaker", "message_types", "raw_tcp", "request_type"]

STREAM_FRAMES = 5000  # frames of one stream test_frames.py proves invalid; the fuzzer sends no more
_OPT = protocol.OptimizerSpec(name="SGD", kwargs={"lr": 0.1})
_TENSOR = protocol.BoundaryTensor(name="h", dtype="float64", shape=[4, 12], requires_grad=True, batch_dim=0)
_BOUNDARY = protocol.BoundarySpec(structure="tensor", tensors=[_TENSOR], batch_size=4)
_PARAM = protocol.ParamInfo(name="cell0.weight", dtype="float64", shape=[12, 6])
_KV = registry_protocol.KeyValueMsg(key="/cellmesh/j/workers/local-0", value=b"\x80", revision=3)
_EVENT = registry_protocol.EventMsg(kind="put", key="/cellmesh/j/workers/local-0", value=b"\x80", revision=3)
_PHASE = protocol.PhaseTiming(name="optimizer", start=1.0, end=2.0)
_SAVE = protocol.SaveRequest(directory="/etc/cron.d", step=3)  # a place no checkpoint may go
_SAVED = protocol.SavedPart(step=3, part="r0-s0", model=True)
_TIED = protocol.TiedParam(name="cell5.weight", key="cell0.weight", stages=[0, 1])

SEEDS: list[Message] = [
    # services/protocol/
    protocol.WorkerCard(name="local-0", address="tcp://127.0.0.1:5555", pid=1, cpus=1, memory_bytes=1 << 30,
                        gpus=0, services=["compute-r0-s0"], rank=0, world_size=2),
    protocol.Assignment(service="compute-r9-s0", kind="compute", factory="os:system", nodes=[0, 1], seed=1,
                        options={"stage": 0, "num_stages": 1, "factory_kwargs": {"command": "true"}}),
    protocol.Release(service="compute-r0-s0"),
    protocol.AssignmentReply(service="compute-r0-s0", address="tcp://127.0.0.1:5555"),
    protocol.WorkerStatus(name="local-0", services=["compute-r0-s0"], draining=False),
    _OPT,
    _PARAM,
    protocol.ShardSetup(mode="sync", replicas=2, optimizer=_OPT, params=[_PARAM]),
    protocol.ShardInfo(service="ps-0", ready=True, mode="sync", replicas=2, version=3, clocks=[3, 3],
                       params=[_PARAM]),
    protocol.PullRequest(replica=0, min_version=1, timeout_ms=100, params=["cell0.weight"]),
    protocol.PullReply(version=1, clocks=[1, 1]),
    protocol.PushRequest(replica=0, step=1, seq=1, part=0, parts=1),
    protocol.PushReply(version=1, duplicate=False),
    protocol.BarrierArrive(name="b", member="local-0", members=["local-0", "local-1"], timeout_ms=100),
    protocol.BarrierReleased(name="b", generation=1),
    _TENSOR,
    _BOUNDARY,
    protocol.ShardAddress(address="tcp://127.0.0.1:5555", service="ps-0"),
    protocol.ComputeOptions(stage=0, num_stages=2, registry="tcp://127.0.0.1:5556", comm_prefix="/p",
                            data="m:data", loss="m:loss", outgoing=_BOUNDARY),
    protocol.Action(stage=0, kind="SEND_F", microbatch=1),
    protocol.CommitStep(step=1, optimizer=_OPT, timeout_ms=1000),
    protocol.CommitReply(step=1, optimizer_steps=1, phases=[_PHASE]),
    protocol.RunStep(step=1, microbatches=[[0, 1], [2, 3]], actions=[protocol.Action(stage=0, kind="F",
                                                                                     microbatch=0)],
                     commit=protocol.CommitStep(step=0, optimizer=_OPT)),
    protocol.StepWindow(microbatches=[[[4, 5], [6, 7]]], optimizer=_OPT, first_commit=1, clip_grad_norm=1.0,
                        nonfinite="skip"),
    protocol.RunStep(step=1, microbatches=[[0, 1], [2, 3]], program="train",
                     window=protocol.StepWindow(microbatches=[[[4, 5], [6, 7]]], optimizer=_OPT,
                                                first_commit=0)),
    protocol.StepProgram(actions=[protocol.Action(stage=0, kind="F", microbatch=0)], source="eval"),
    protocol.LoadProgram(program="train", num_microbatches=2, actions=[protocol.Action(stage=0, kind="F",
                                                                                       microbatch=0)]),
    _PHASE,
    protocol.StepReply(step=1, stage=0, losses=[0.5], times=protocol.pack_times([1.0], [2.0]),
                       phases=[_PHASE]),
    protocol.WindowReply(steps=[protocol.StepReply(step=1, stage=0, losses=[0.5]),
                                protocol.StepReply(step=2, stage=0, losses=[0.25])], committed=[True]),
    protocol.TensorsReply(names=["cell0.weight"], missing=[]),
    protocol.ZeroGradRequest(set_to_none=True),
    protocol.OptimizerStepRequest(optimizer=_OPT),
    protocol.OptimizerStepReply(steps=1),
    protocol.Reconnect(comm_prefix="/p/2", dp_prefix="/dp/2"),
    _SAVE,
    _SAVED,
    protocol.SavedParts(parts=[_SAVED]),
    protocol.ShardSave(save=_SAVE, version=3, part="ps-s0-0", timeout_ms=1000),
    _TIED,
    protocol.TiedOptions(prefix="/t", params=[_TIED]),
    protocol.TurnsOptions(key="run/r0/rank0", order=[protocol.Action(stage=0, kind="F", microbatch=0),
                                                     protocol.Action(stage=2, kind="F", microbatch=0)]),
    protocol.SchedulerSpec(name="StepLR", kwargs={"step_size": 2, "gamma": 0.5}),
    protocol.RoundNormRequest(version=3, timeout_ms=1000),
    protocol.RoundNorm(version=3, sq_norm=0.25),
    protocol.ApplyRound(version=3, grad_scale=0.5, train_step=7),
    Empty(),
    # comm/registry/protocol.py
    _KV,
    _EVENT,
    registry_protocol.PutRequest(key="/cellmesh/j/workers/evil", value=b"x", lease=None),
    registry_protocol.GetRequest(key="/cellmesh/j/workers/local-0"),
    registry_protocol.DeleteRequest(key="/cellmesh/j/workers/local-0"),
    registry_protocol.ListRequest(prefix="/cellmesh/"),
    registry_protocol.CasRequest(key="/cellmesh/j/workers/local-0", expected=None, value=b"x"),
    registry_protocol.LeaseGrantRequest(ttl_ms=1000),
    registry_protocol.LeaseRequest(lease=1),
    registry_protocol.WatchPollRequest(prefix="/cellmesh/", from_revision=1, wait_ms=0),
    registry_protocol.RevisionReply(revision=1),
    registry_protocol.GetReply(kv=_KV),
    registry_protocol.BoolReply(value=True),
    registry_protocol.ListReply(items=[_KV]),
    registry_protocol.LeaseReply(lease=1, ttl_ms=1000),
    registry_protocol.EventsReply(events=[_EVENT], revision=3),
]
"""One valid message of every type the job's control plane speaks (``test_frames.py`` checks: every one)."""


def message_types() -> list[type[Message]]:
    """Every message class of ``services/protocol/`` and ``comm/registry/protocol.py``."""
    found: list[type[Message]] = []
    for module in (protocol, registry_protocol):
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type) and issubclass(obj, Message) and obj not in found:
                found.append(obj)
    return found


def _methods(cls: type) -> dict[str, type[BaseModel]]:
    """``rpc_<name>`` methods of a service class and their request types (as the host finds them)."""
    out: dict[str, type[BaseModel]] = {}
    for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction):
        if not name.startswith("rpc_") or name == "rpc_methods":
            continue
        hints = typing.get_type_hints(fn)
        first = next(p for p in inspect.signature(fn).parameters if p != "self")
        out[name[4:]] = hints[first]
    return out


SERVICE_METHODS: dict[str, dict[str, type[BaseModel]]] = {
    "worker": _methods(_Control),
    "compute": _methods(CellComputeService),
    "param_server": _methods(ParamServerService),
    "barrier": _methods(BarrierService),
    "registry": _methods(RegistryService),
}
"""Service kind -> method -> request type, read from the service classes the job runs."""


def request_type(kind: str, method: str) -> type[BaseModel] | None:
    return SERVICE_METHODS.get(kind, {}).get(method)


_SEED_BY_TYPE: dict[type[BaseModel], Message] = {type(m): m for m in SEEDS}
_BAD_VERSIONS: list[object] = [0, 2, PROTOCOL_VERSION + 40, -1, str(PROTOCOL_VERSION), None, b"\x01", [1]]
_FAR = 1 << 62
Frames = list[bytes]


class FrameMaker:
    """A deterministic stream of invalid frames (same ``seed``, same frames)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self._rtype: type[BaseModel] | None = None  # the request type of the frame being made
        self.made = 0  # frames made so far (control and data)

    # -- values -------------------------------------------------------------------------

    def junk(self, depth: int = 0) -> Any:
        """A random msgpack-able value: scalars, huge ones, strings, bytes, nested lists and maps."""
        r = self.rng
        pick = r.randrange(12 if depth < 3 else 8)
        if pick == 0:
            return r.choice([0, -1, 1, _FAR, -_FAR, (1 << 64) - 1, -(1 << 63)])
        if pick == 1:
            return r.choice([0.0, -1.5, 1e308, float("inf"), float("nan")])
        if pick == 2:
            return r.choice([True, False, None])
        if pick == 3:
            return "".join(r.choice("abc/\x00\u00e9\U0001f600:") for _ in range(r.randrange(0, 12)))
        if pick == 4:
            return "x" * r.choice([256, 257, 4096, 1 << 16])
        if pick == 5:
            return r.randbytes(r.randrange(0, 64))
        if pick == 6:
            return r.randrange(-1000, 1000)
        if pick == 7:
            return r.choice(["float32", "quaternion", "compute", "worker", "registry", "os:system"])
        if pick == 8:
            return [self.junk(depth + 1) for _ in range(r.randrange(0, 5))]
        if pick == 9:
            return list(range(r.choice([100, 10_000])))
        if pick == 10:
            return {str(self.junk(depth + 1))[:20]: self.junk(depth + 1) for _ in range(r.randrange(0, 4))}
        return {r.randrange(10): "int key"}  # a non-string key: strict_map_key refuses it

    def _mutate_value(self, body: dict[str, Any]) -> None:
        """Noise: one field gets a random value (maybe still valid; never the only defect)."""
        if body:
            key = self.rng.choice(sorted(body))
            body[key] = self.junk()

    # -- control frames -----------------------------------------------------------------

    def body(self, rtype: type[BaseModel] | None) -> dict[str, Any]:
        """A real message as a dict: the method's request type most of the time, any type otherwise."""
        seed = _SEED_BY_TYPE.get(rtype) if rtype is not None and self.rng.random() < 0.7 else None
        if seed is None:
            seed = self.rng.choice(SEEDS)
        return seed.model_dump(mode="python")

    def control(self, service: str, kind: str) -> list[bytes]:
        """One request's frames for ``service`` (of ``kind``: a key of :data:`SERVICE_METHODS`)."""
        self.made += 1
        r = self.rng.random()
        if r < 0.04:
            return [self.rng.randbytes(self.rng.randrange(0, 2048)) for _ in range(self.rng.randrange(1, 4))]
        if r < 0.08:
            return [_pack(self.junk())]
        methods = SERVICE_METHODS[kind]
        method = self.rng.choice(sorted(methods)) if self.rng.random() < 0.9 else str(self.junk())[:40]
        self._rtype = methods.get(method)
        body = self.body(self._rtype)
        envelope: dict[str, Any] = {"id": self.rng.randrange(1, 1 << 31), "service": service,
                                    "method": method, "body": body, "tensors": [], "v": PROTOCOL_VERSION}
        tensors: list[bytes] = []
        defects: list[Callable[[dict[str, Any], dict[str, Any], Frames], None]] = [
            self._extra_field, self._drop_required, self._bad_version, self._envelope_extra,
            self._truncated_tensor, self._missing_frames, self._bad_tensor_spec, self._bad_envelope_field,
        ]
        for defect in self.rng.sample(defects, self.rng.randrange(1, 3)):
            defect(envelope, body, tensors)
        for _ in range(self.rng.randrange(0, 3)):
            self._mutate_value(body)
        return [_pack(envelope), *tensors]

    @staticmethod
    def huge_control() -> list[bytes]:
        """One frame over the control sockets' size limit (libzmq drops the connection)."""
        return [b"\x81" + b"\0" * CONTROL_MAX_MESSAGE]

    def _extra_field(self, envelope: dict[str, Any], body: dict[str, Any], tensors: Frames) -> None:
        body[self.rng.choice(["zz_fuzz", "__class__", "command", "v2"])] = self.junk()

    def _drop_required(self, envelope: dict[str, Any], body: dict[str, Any], tensors: Frames) -> None:
        # certain only against the body's own type: {"service": ...} less its field is a valid Empty
        seed_type, fields = _fields_of(body)
        required = [k for k, f in fields.items() if f] if seed_type is self._rtype else []
        if required:
            del body[self.rng.choice(required)]
        else:
            self._extra_field(envelope, body, tensors)

    def _bad_version(self, envelope: dict[str, Any], body: dict[str, Any], tensors: Frames) -> None:
        if self.rng.random() < 0.2:
            del envelope["v"]
        else:
            envelope["v"] = self.rng.choice(_BAD_VERSIONS)

    def _envelope_extra(self, envelope: dict[str, Any], body: dict[str, Any], tensors: Frames) -> None:
        envelope[self.rng.choice(["zz", "error", "ok", "role"])] = self.junk()

    def _bad_envelope_field(self, envelope: dict[str, Any], body: dict[str, Any], tensors: Frames) -> None:
        key = self.rng.choice(["id", "service", "method", "body", "tensors"])
        wrong: dict[str, list[object]] = {
            "id": [-1, "7", 1.5, None, [1]],
            "service": [7, None, "", "x" * 257, ["worker"]],
            "method": [7, None, "", "x" * 257, b"assign"],
            "body": [[1, 2], "body", 7, None],
            "tensors": ["t", [1], {"name": "t"}, None],
        }
        envelope[key] = self.rng.choice(wrong[key])

    @staticmethod
    def _specs(envelope: dict[str, Any]) -> list[Any]:
        """The envelope's tensor specs as a list (another defect may have replaced them by junk)."""
        if not isinstance(envelope["tensors"], list):
            envelope["tensors"] = []
        specs: list[Any] = envelope["tensors"]
        return specs

    def _spec(self, name: str, dtype: str, shape: list[int], frames: int) -> dict[str, Any]:
        return {"name": name, "dtype": dtype, "shape": shape, "frames": frames}

    def _truncated_tensor(self, envelope: dict[str, Any], body: dict[str, Any], tensors: Frames) -> None:
        n = self.rng.randrange(1, 4096)
        dtype = self.rng.choice(sorted(DTYPES))
        nbytes = n * DTYPES[dtype].itemsize
        self._specs(envelope).append(self._spec(f"t{len(tensors)}", dtype, [n], 1))
        cut = self.rng.randrange(1, nbytes + 1) * self.rng.choice([-1, 1])  # short or long, never exact
        tensors.append(self.rng.randbytes(max(0, nbytes + cut)))

    def _missing_frames(self, envelope: dict[str, Any], body: dict[str, Any], tensors: Frames) -> None:
        self._specs(envelope).append(self._spec(f"m{len(tensors)}", "float32", [4], self.rng.randrange(2, 6)))
        tensors.append(bytes(16))  # one frame where the spec announces several

    def _bad_tensor_spec(self, envelope: dict[str, Any], body: dict[str, Any], tensors: Frames) -> None:
        over = MAX_TENSOR_BYTES // 4 + 1
        spec = self.rng.choice([
            self._spec("huge", "float32", [over], 1),
            self._spec("huge2", "float64", [1 << 20, 1 << 20], 1),
            self._spec("zero-dim-huge", "float32", [0, 1 << 62], 1),
            self._spec("dims", "float32", [1] * (MAX_NDIM + 1), 1),
            self._spec("neg", "float32", [-4], 1),
            self._spec("odd", "quaternion", [4], 1),
            self._spec("many", "uint8", [4], (1 << 20) + 1),
            self._spec("", "uint8", [4], 1),
            {"name": "x", "dtype": "uint8"},
        ])
        self._specs(envelope).append(spec)
        tensors.append(bytes(self.rng.choice([0, 4, 16])))

    # -- data frames --------------------------------------------------------------------

    def data(self, peer: int) -> list[bytes]:
        """One data message for the PULL socket a rank bound for ``peer`` (header, body)."""
        self.made += 1
        r = self.rng
        if r.random() < 0.1:
            return [r.randbytes(r.randrange(0, 256)) for _ in range(r.randrange(1, 4))]
        dtype = r.choice(sorted(DTYPES))
        n = r.randrange(0, 64)
        nbytes = n * DTYPES[dtype].itemsize
        group = r.choice(["w", "dp", "pp", "", "g" * 40])
        fields: list[Any] = [PROTOCOL_VERSION, group, peer, r.randrange(2), r.randrange(0, 1 << 20),
                             r.randrange(-10, 10), 0, dtype, [n], 0, nbytes, -1]
        body: list[bytes] = [r.randbytes(nbytes)]
        chosen = r.sample(_DATA_DEFECTS, r.randrange(1, 3))
        for defect in sorted(chosen, key=lambda d: d is _not_twelve_fields):  # the one that cuts fields last
            defect(self, fields, body)
        return [_pack(fields), *body]


    def door(self) -> list[bytes]:
        """One request for a rank's door (``comm/zmq/door.py``), each with a certain defect."""
        self.made += 1
        r = self.rng
        if r.random() < 0.1:
            return [r.randbytes(r.randrange(0, 256)) for _ in range(r.randrange(1, 4))]
        fields: dict[str, Any] = {"v": PROTOCOL_VERSION, "src": r.randrange(0, 4),
                                  "host_key": "h" * r.randrange(40)}
        defect = r.randrange(6)
        if defect == 0:
            fields[r.choice(["evil", "tcp", "shm", "srcs"])] = r.choice([1, "x", None, [1]])
        elif defect == 1:
            fields["v"] = r.choice(_BAD_VERSIONS)
        elif defect == 2:
            fields["src"] = r.choice([-1, "0", None, 1.5, [0], True])
        elif defect == 3:
            del fields[r.choice(["src", "host_key"])]
        elif defect == 4:
            fields["host_key"] = r.choice([7, None, "k" * 600, b"h"])
        else:
            return [_pack(fields), b"extra", *([b"x"] * r.randrange(0, 2))]  # a request is one frame
        return [_pack(fields)]


def _pack(value: Any) -> bytes:
    data = msgpack.packb(value, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


def _fields_of(body: dict[str, Any]) -> tuple[type[BaseModel] | None, dict[str, bool]]:
    """The seed type ``body`` was dumped from, and which of its keys it requires (True) or defaults."""
    for seed in SEEDS:
        if seed.model_dump(mode="python") == body:
            return type(seed), {k: f.is_required() for k, f in type(seed).model_fields.items()}
    return None, {}


# Each breaks a rule of comm/wire.py's decode_header or of the transport's own checks.
def _wrong_version(m: FrameMaker, f: list[Any], body: list[bytes]) -> None:
    f[0] = m.rng.choice(_BAD_VERSIONS)


def _unknown_dtype(m: FrameMaker, f: list[Any], body: list[bytes]) -> None:
    f[7] = m.rng.choice(["quaternion", "float128", "", 7, None])


def _huge_shape(m: FrameMaker, f: list[Any], body: list[bytes]) -> None:
    f[8] = m.rng.choice([[MAX_TENSOR_BYTES + 1], [1 << 20, 1 << 20, 1 << 20], [0, 1 << 62], [-4],
                         [1] * (MAX_NDIM + 1), ["4"], [True], 4, None])


def _past_the_tensor(m: FrameMaker, f: list[Any], body: list[bytes]) -> None:
    f[9] = m.rng.choice([(1 << 20) + 1, -1, 1 << 40])  # the tensors here are under 1 KiB


def _wrong_length(m: FrameMaker, f: list[Any], body: list[bytes]) -> None:
    if not body:  # a slot's header already lost its body: give it one it must not have
        body.append(b"")
    body[0] = body[0] + b"\0" if m.rng.random() < 0.5 or not body[0] else body[0][:-1]


def _another_source(m: FrameMaker, f: list[Any], body: list[bytes]) -> None:
    f[2] = f[2] + m.rng.randrange(1, 1000) if m.rng.random() < 0.8 else m.rng.choice([-1, "0", None])


def _extra_frames(m: FrameMaker, f: list[Any], body: list[bytes]) -> None:
    body.extend([b"extra"] * m.rng.randrange(1, 3))


def _bad_slot(m: FrameMaker, f: list[Any], body: list[bytes]) -> None:
    if m.rng.random() < 0.5:
        f[11] = m.rng.randrange(0, shm.SLOTS)  # a slot, yet a body frame comes along
    else:
        f[11] = m.rng.randrange(shm.SLOTS, 1 << 16)  # no such slot
        body.clear()


def _not_twelve_fields(m: FrameMaker, f: list[Any], body: list[bytes]) -> None:
    if m.rng.random() < 0.5:
        f.append(0)
    else:
        del f[m.rng.randrange(len(f)):]


def _bad_field_type(m: FrameMaker, f: list[Any], body: list[bytes]) -> None:
    index = m.rng.choice([3, 4, 5, 6, 9, 10])
    f[index] = m.rng.choice([str(f[index]), float(f[index]) + 0.5, None, [f[index]], 1 << 63])


def _huge_header(m: FrameMaker, f: list[Any], body: list[bytes]) -> None:
    f[1] = "g" * m.rng.choice([257, 5000])


_DATA_DEFECTS: list[Callable[[FrameMaker, list[Any], list[bytes]], None]] = [
    _wrong_version, _unknown_dtype, _huge_shape, _past_the_tensor, _wrong_length, _another_source,
    _extra_frames, _bad_slot, _not_twelve_fields, _bad_field_type, _huge_header,
]


def raw_tcp(rng: random.Random) -> bytes:
    """Bytes for a plain TCP connection: noise, or a ZeroMQ greeting that goes wrong."""
    pick = rng.randrange(4)
    if pick == 0:
        return rng.randbytes(rng.randrange(1, 512))
    if pick == 1:  # a ZMTP 3 signature and version, then garbage for the mechanism
        return b"\xff" + bytes(8) + b"\x7f\x03\x00" + rng.randbytes(rng.randrange(0, 80))
    if pick == 2:  # a NULL-mechanism greeting: the handshake reaches the ZAP handler and is refused
        return b"\xff" + bytes(8) + b"\x7f\x03\x00NULL" + bytes(16) + b"\x00" + bytes(31) + rng.randbytes(32)
    return b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"

