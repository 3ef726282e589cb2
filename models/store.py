"""The model store: every *.gguf in the models directory, opened with gguf's reader.

A model's id is its file name without `.gguf`; names starting with '.' are writers' temporary files
(`qgemm fetch`'s `.fetch-*.gguf.part`, ...) and are never listed.  A file that cannot be read, or
whose header contradicts itself, is listed with status "error" and never breaks the others.
Requests name models and tensors by id and are answered only from what a scan found, so no request
can reach a path outside the directory.

Files change under a running server (rewritten in place, replaced by a rename, truncated, deleted),
so nothing here trusts a table read earlier:
- each model records its file's identity (device, inode, size, mtime, ctime), and `lookup` compares
  it with the file's before every use: a changed file is re-read, a removed one is gone (404);
  retiring a version tells `on_retire`, which drops what was derived from it (GPU copies, caches);
- the header is parsed from a private copy of its bytes, never from a mapping of the file: a
  mapped page of a file truncated meanwhile kills the process (SIGBUS) when touched;
- tensor bytes are read with plain reads, and the file's identity is checked after the read: bytes
  that do not match the table raise FileChanged instead of reaching a product.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from kernels.formats import FORMATS, MATMUL_TYPES

MiB = 1 << 20
FIRST_HEADER_READ = 4 * MiB  # most headers fit; a tokenizer of 150k tokens takes ~5 MiB
DEFAULT_MAX_HEADER_BYTES = 64 * MiB  # a header is parsed into Python objects (~20x its bytes): this bounds them


class NotFound(LookupError):
    pass


class FileChanged(RuntimeError):
    """The file no longer is the one whose table a request used; the store re-reads it on next use."""


@dataclass(frozen=True)
class FileId:
    """What says that a path still holds the same bytes: a rename gives a new inode, a rewrite a new
    size or mtime (to the file system's clock granularity, a few ms at worst)."""
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileId:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # row-major: a matrix is [N, K] (GGUF's ne is [K, N])
    n_elements: int
    n_bytes: int
    offset: int  # absolute offset of the data in the file

    @property
    def matmul(self) -> bool:
        return self.matmul_reason is None

    @property
    def matmul_reason(self) -> str | None:
        """Why this tensor cannot be a matmul's weights, or None."""
        if len(self.shape) != 2:
            return f"tensor {self.name!r} has {len(self.shape)} dimension(s); matmul needs a 2-D matrix"
        if self.type_name not in MATMUL_TYPES:
            return (f"tensor {self.name!r} is {self.type_name}; matmul supports "
                    f"{', '.join(sorted(MATMUL_TYPES))}")
        return None


@dataclass
class Model:
    id: str
    path: Path
    file: FileId
    status: str = "ok"
    error: str | None = None
    reader: GGUFReader | None = None  # over a copy of the header: fields only, no tensor data
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    _layout: dict[str, tuple[np.dtype, tuple[int, ...]]] = field(default_factory=dict, repr=False)

    @property
    def size_bytes(self) -> int:
        return self.file.size

    @property
    def version_key(self) -> tuple[Any, ...]:
        """Identifies this exact file; caches of derived data key on it."""
        f = self.file
        return (self.id, f.dev, f.ino, f.size, f.mtime_ns, f.ctime_ns)

    @property
    def architecture(self) -> str | None:
        if self.reader is None:
            return None
        f = self.reader.fields.get("general.architecture")
        return str(field_contents(f)) if f is not None else None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (values for F32/F16) in the shape gguf's reader gives them, read from the
        file now; FileChanged if the file is no longer the one the table was read from."""
        info = self.tensors[name]
        dtype, shape = self._layout[name]
        out = np.empty(info.n_bytes, np.uint8)
        try:
            with open(self.path, "rb", buffering=0) as fh:
                if FileId.of(os.fstat(fh.fileno())) != self.file:
                    raise FileChanged(f"model {self.id!r}: {self.path.name} changed since it was read")
                view, done = memoryview(out), 0
                while done < info.n_bytes:
                    n = os.preadv(fh.fileno(), [view[done:]], info.offset + done)
                    if n <= 0:
                        break
                    done += n
                if done < info.n_bytes or FileId.of(os.fstat(fh.fileno())) != self.file:
                    raise FileChanged(f"model {self.id!r}: {self.path.name} changed while {name!r} was read")
        except FileNotFoundError:
            raise FileChanged(f"model {self.id!r}: {self.path.name} was removed") from None
        return out.view(dtype).reshape(shape)


def field_contents(field: Any, index: int | slice = slice(None)) -> Any:
    """A metadata field's value (gguf's `contents`), with strings that are not UTF-8 decoded with U+FFFD
    for the bad bytes instead of raising: a file's bytes are whatever its writer put there."""
    try:
        return field.contents(index)
    except UnicodeDecodeError:
        def text(part: np.ndarray) -> str:
            return part.tobytes().decode("utf-8", "replace")
        if field.types[0] == GGUFValueType.STRING:
            return text(field.parts[-1])
        picked = field.data[index]
        return text(field.parts[picked]) if isinstance(index, int) else [text(field.parts[i]) for i in picked]


class _HeaderReader(GGUFReader):
    """gguf's reader over a copy of the header alone.  Tensor data views are shape-only placeholders
    (zero strides, no memory): the store reads tensor bytes itself, so nothing maps the file."""

    _placeholders = False

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        self._placeholders = True
        try:
            super()._build_tensors(start_offs, fields)
        finally:
            self._placeholders = False

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if self._placeholders:
            return np.broadcast_to(np.zeros((), dtype), (int(count),))
        return super()._get(offset, dtype, count, override_order)


def _header_copy(data: bytes) -> Any:
    """An anonymous file holding `data` (the reader maps files, not bytes)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("qgemm-gguf-header", os.MFD_CLOEXEC)
        fh = open(fd, "w+b")
    else:
        fh = tempfile.TemporaryFile()
    fh.write(data)
    fh.flush()
    fh.seek(0)
    return fh


def _read_header(fh: Any, size: int, max_header: int) -> GGUFReader:
    """Parse the header from a growing prefix of the file: a parse that needed bytes past the prefix
    fails or ends at its edge, and is repeated on a longer one, up to `max_header` bytes."""
    prefix = min(size, FIRST_HEADER_READ, max_header)
    while True:
        data = os.pread(fh.fileno(), prefix, 0)
        if len(data) < prefix:
            raise FileChanged("the file shrank while its header was read")
        error: Exception | None = None
        with _header_copy(data) as copy:
            try:
                with np.errstate(all="ignore"):  # hostile counts overflow numpy scalars: checked in _open
                    reader = _HeaderReader(copy, "r")
                if prefix == size or reader.data_offset < prefix:
                    return reader
            except Exception as exc:  # gguf raises IndexError, ValueError, ... on cut or garbled headers
                error = exc
        if prefix >= min(size, max_header):
            if prefix < size:
                raise ValueError(f"the header is larger than the limit of {max_header} bytes "
                                 "(QGEMM_MAX_HEADER_BYTES) or garbled")
            assert error is not None
            raise ValueError(f"corrupt or truncated GGUF ({type(error).__name__}: {error})") from error
        prefix = min(size, max_header, prefix * 4)


def _open(model: Model, max_header: int) -> None:
    with open(model.path, "rb", buffering=0) as fh:
        if FileId.of(os.fstat(fh.fileno())) != model.file:
            raise FileChanged("the file changed while it was opened")
        size = model.file.size
        if size == 0:
            raise ValueError("file is empty")
        if os.pread(fh.fileno(), 4, 0) != b"GGUF":
            raise ValueError("not a GGUF file (magic bytes are not 'GGUF')")
        reader = _read_header(fh, size, max_header)
        if FileId.of(os.fstat(fh.fileno())) != model.file:
            raise FileChanged("the file changed while its header was read")
    tensors: dict[str, TensorInfo] = {}
    layout: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    for t in reader.tensors:
        ttype = GGMLQuantizationType(int(t.tensor_type))
        shape = tuple(int(s) for s in reversed([int(x) for x in t.shape]))
        n_el = int(t.n_elements)
        if int(np.prod(shape, dtype=object)) != n_el or n_el < 0:
            raise ValueError(f"tensor {t.name!r}: shape {shape} does not hold {n_el} elements")
        if int(reader.data_offset) + int(t.field.parts[-1][0]) != int(t.data_offset):
            raise ValueError(f"tensor {t.name!r}: its data offset {int(t.field.parts[-1][0])} overflows 64 bits")
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ValueError(f"tensor {t.name!r} ends at byte {end}, past the end of the file "
                             f"({size} bytes): truncated?")
        fmt = FORMATS.get(ttype)
        if fmt is not None and len(shape) >= 1 and shape[-1] % fmt.block_values:
            raise ValueError(f"tensor {t.name!r}: row of {shape[-1]} is not whole {fmt.name} blocks")
        tensors[t.name] = TensorInfo(t.name, ttype.name, shape, n_el, int(t.n_bytes), int(t.data_offset))
        layout[t.name] = (t.data.dtype, tuple(int(s) for s in t.data.shape))
    model.reader, model.tensors, model._layout = reader, tensors, layout


class ModelStore:
    def __init__(self, models_dir: Path, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                 on_retire: Callable[[Model], None] | None = None):
        self.models_dir = Path(models_dir)
        self.max_header_bytes = max_header_bytes
        self.on_retire = on_retire  # told of each version that is replaced or removed
        self._models: dict[str, Model] = {}
        self._lock = threading.RLock()

    def _retire(self, model: Model) -> None:
        if self.on_retire is not None and model.status == "ok":
            self.on_retire(model)

    def _read(self, model_id: str, path: Path, old: Model | None) -> Model | None:
        """The model at `path` now: `old` if the file is still the same, a fresh read if not, None if gone."""
        for _ in range(3):  # a file replaced while it was read is read again
            try:
                st = path.stat()
            except OSError:
                return None  # vanished, or a broken link
            if not path.is_file():
                return None
            if old is not None and old.path == path and old.file == FileId.of(st):
                return old
            model = Model(model_id, path, FileId.of(st))
            try:
                _open(model, self.max_header_bytes)
            except FileChanged:
                continue
            except Exception as exc:  # any way a file can be broken: list it, keep the others
                model.status, model.error = "error", f"{type(exc).__name__}: {exc}"
                model.reader, model.tensors = None, {}
            return model
        model.status, model.error = "error", "FileChanged: the file kept changing while it was read"
        return model

    def scan(self) -> list[Model]:
        """Re-read the directory; files unchanged since the last look keep their table."""
        with self._lock:
            found: dict[str, Model] = {}
            paths = sorted(self.models_dir.glob("*.gguf")) if self.models_dir.is_dir() else []
            for path in paths:
                if path.name.startswith("."):
                    continue
                model_id = path.name[: -len(".gguf")]
                model = self._read(model_id, path, self._models.get(model_id))
                if model is not None:
                    found[model_id] = model
            for model_id, old in self._models.items():
                if found.get(model_id) is not old:
                    self._retire(old)
            self._models = found
            return list(found.values())

    def lookup(self, model_id: str) -> Model | None:
        """The model if it is known and its file unchanged (one stat: cheap enough for every request),
        else None: then `get` re-reads it, which can take seconds (a thread's work, not an event loop's)."""
        model = self._models.get(model_id)
        if model is None:
            return None
        try:
            st = os.stat(model.path)
        except OSError:
            return None
        return model if FileId.of(st) == model.file else None

    async def current(self, model_id: str) -> Model:
        """`get` for event-loop code: the one stat on the loop, a re-read on a thread."""
        return self.lookup(model_id) or await asyncio.to_thread(self.get, model_id)

    def get(self, model_id: str) -> Model:
        model = self.lookup(model_id)
        if model is not None:
            return model
        with self._lock:
            old = self._models.get(model_id)
            path = self.models_dir / f"{model_id}.gguf"
            valid = bool(model_id) and not model_id.startswith(".") and "/" not in model_id and "\0" not in model_id
            model = self._read(model_id, path, old) if valid else None
            if old is not None and model is not old:
                self._retire(old)
            if model is None:
                self._models.pop(model_id, None)
                raise NotFound(f"model {model_id!r} not found; known models: {', '.join(sorted(self._models))}")
            self._models[model_id] = model
            return model

    @staticmethod
    def tensor_of(model: Model, name: str) -> tuple[Model, TensorInfo]:
        if model.status != "ok":
            raise NotFound(f"model {model.id!r} could not be read: {model.error}")
        info = model.tensors.get(name)
        if info is None:
            raise NotFound(f"tensor {name!r} not found in model {model.id!r}")
        return model, info
