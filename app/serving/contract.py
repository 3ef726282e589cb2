"""The contract between a front process and an engine process, declared once: every message that crosses the
channel (app/serving/channel.py) is one of the msgspec Structs below, and a frame is a list of them (what one
loop turn has to say, encoded once).  Payloads never cross here: a Matmul names where its X and Y sit in the
front's shared-memory arena (app/serving/arenas.py).

Errors cross as themselves: an engine that raises one of the domain's errors (kernels/errors.py, the store's
NotFound, Unreadable and FileChanged) answers `Failed` with its class name, and the front raises the same class
again, so that app/errors.py maps it to HTTP at the edge, as in one process.

The structs are array-like (a msgpack array, no field names on the wire) and untracked by the garbage collector:
a Matmul encodes in ~0.3 µs and a frame of 64 decodes in ~15 µs (msgspec, 2-core CPU machine).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from kernels.errors import Conflict, DeviceOutOfMemory, InvalidRequest, Overloaded, QgemmError
from models.store import FileChanged, NotFound, Unreadable

Scheme = tuple[str, int, bool]  # a requantization (kernels/requant.py's Scheme): format, blocksize, double_quant


class Message(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Every message carries the id its answer names (set by the channel)."""

    id: int = 0


# -- front -> engine -------------------------------------------------------------------------------------------
class Matmul(Message, tag=1):
    """Y = X · Wᵀ with X and Y in a front's arena.  The front checked the request against `version` (the file it
    saw): the engine multiplies that version's tensor, or answers FileChanged where its own differs."""

    model: str = ""
    version: tuple = ()  # models.store.Model.version_key
    tensor: str = ""
    kernel: str = "auto"
    scheme: Scheme | None = None
    segment: str = ""  # the arena (or a segment of the request's own, `own`)
    x: int = 0  # byte offsets of X [m, k] and Y [m, n] float32 in the segment
    y: int = 0
    m: int = 0
    k: int = 0
    n: int = 0
    own: bool = False
    amax: float | None = None  # max|X| (NaN where X holds one), measured by the front as it wrote X
    part: tuple[int, int] | None = None  # a tensor split across engines: W's rows [start, stop) this engine
    # multiplies, whose columns of Y [m, n] (row stride n) it writes; None: the whole tensor


class Health(Message, tag=2):
    pass


class Kernels(Message, tag=3):
    pass


class MetricsText(Message, tag=4):
    pass


class Residency(Message, tag=5):
    model: str = ""


class Load(Message, tag=6):
    model: str = ""
    tensors: list[str] = []
    kernel: str | None = None
    scheme: Scheme | None = None
    devices: list[int] | None = None
    placement: Literal["replicate", "split"] | None = None
    alone: bool = True  # the server's only engine (a CPU backend of one device then has nothing to load)
    part: tuple[int, int] | None = None  # this engine's rows [start, stop) of a tensor split across engines


class Unload(Message, tag=7):
    model: str = ""
    tensors: list[str] | None = None


class QuantTimes(Message, tag=8):
    model: str = ""
    tensor: str = ""
    rows: list[dict[str, Any]] = []
    schemes: list[Scheme] = []
    ms: list[int] = []


class Ping(Message, tag=9):
    """The supervisor's watchdog: an engine whose loop turns answers at once."""


class Splits(Message, tag=10):
    """The blocks of rows this engine holds of tensors split across engines: a Reply of [model, tensor, weight
    format tag, start, stop] rows."""


# -- engine -> front -------------------------------------------------------------------------------------------
class Done(Message, tag=20):
    """A Matmul's answer: Y is in the slot; how it was computed.  One Done answers every request of a frame that
    ran in the same batch (`more`): the engine makes and encodes one answer per batch, not per request."""

    kernel: str = ""
    backend: str = ""
    activation_format: str = ""
    timing: dict[str, float] = {}
    batch: tuple[int, int, int] = (1, 1, 1)  # requests and rows of the largest batch it ran in, chunks
    queue_ms: float = 0.0
    devices: list[str] = []
    epoch: int = 0  # the engine's count of changes to its splits: a front that sees a new one asks for them again
    more: list[int] = []  # the ids of the other requests this answer is the answer of (they ran in the same batch)


class Reply(Message, tag=21):
    """A control question's answer (JSON-shaped: what the route answers with)."""

    value: Any = None


class Failed(Message, tag=22):
    """An error the engine answers with: `error` names its class (ERRORS), or "internal" for a fault of its own."""

    error: str = "internal"
    code: str = "internal"
    message: str = ""


Request = Matmul | Health | Kernels | MetricsText | Residency | Load | Unload | QuantTimes | Ping | Splits
Answer = Done | Reply | Failed

# the errors that cross as themselves, by class name
ERRORS: dict[str, type[Exception]] = {cls.__name__: cls for cls in (InvalidRequest, Conflict, Overloaded,
                                                                    DeviceOutOfMemory, NotFound, FileChanged,
                                                                    Unreadable)}


class EngineFault(RuntimeError):
    """A fault inside the engine (a bug, not the request's): the front answers 500 with its message."""


def failed(request_id: int, exc: BaseException) -> Failed:
    """An exception as the answer to request `request_id` (a subclass of a domain error crosses as its base)."""
    for name, cls in ERRORS.items():
        if isinstance(exc, cls):
            code = exc.code if isinstance(exc, QgemmError) else ""
            return Failed(request_id, name, code, exc.message if isinstance(exc, QgemmError) else str(exc))
    return Failed(request_id, "internal", "internal", f"{type(exc).__name__}: {exc}")


def error_of(answer: Failed) -> Exception:
    """The exception an engine's Failed stands for, to raise in the front."""
    cls = ERRORS.get(answer.error)
    if cls is None:
        return EngineFault(answer.message)
    if issubclass(cls, QgemmError):
        return cls(answer.message, answer.code or None)
    return cls(answer.message)


# one encoder and decoder per direction and process (msgspec's are reusable and cheap to call)
_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(list[Request])
_answers = msgspec.msgpack.Decoder(list[Answer])


def encode(messages: list[Any]) -> bytes:
    return _encoder.encode(messages)


def decode_requests(body: bytes | memoryview) -> list[Request]:
    return _requests.decode(body)


def decode_answers(body: bytes | memoryview) -> list[Answer]:
    return _answers.decode(body)
