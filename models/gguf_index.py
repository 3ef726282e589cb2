"""What the service needs of a GGUF file's header, read once per file version with gguf's reader and kept
small: the header's numbers, the metadata summarised (long arrays as type, length and first items), and the
tensor table.  gguf's reader turns every item of a metadata array into numpy objects (Gemma 3's 262k-token
vocabulary: ~10 s and ~700 MB), so a large header is read in a child process (`read_in_child`) and its index
cached on disk per file version (`IndexCache`), while the server keeps only the index.

The header is parsed from a private copy of its bytes, never from a mapping of the file: a mapped page of a
file truncated meanwhile kills the process (SIGBUS) when touched.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import tempfile
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, LlamaFileType

from kernels.formats import FORMATS, MATMUL_TYPES

MiB = 1 << 20
INLINE_HEADER_BYTES = 256 << 10  # a header within this prefix is read at once (milliseconds); larger: in a child
DEFAULT_MAX_HEADER_BYTES = 64 * MiB  # a header is parsed into Python objects (~20x its bytes): this bounds them
ARRAY_HEAD = 8  # items shown of a long array
ARRAY_FULL = 16  # arrays up to this length are shown whole
STRING_MAX = 4096  # longer strings (chat templates) are cut, with their length given
INDEX_VERSION = 1  # of the cached index's form: a new form never reads an old cache


class FileChanged(RuntimeError):
    """The file no longer is the one whose table a request used; the store re-reads it on next use."""


class HeaderTooLarge(ValueError):
    """The header does not fit the prefix a caller allows (it is then read elsewhere, or refused)."""


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


@dataclass(frozen=True)
class GgufIndex:
    header: dict[str, Any]  # version, tensor_count, kv_count, alignment, data_offset, byte_order
    metadata: dict[str, Any]  # every key but GGUF.*, summarised
    tensors: dict[str, TensorInfo]
    layouts: dict[str, tuple[str, tuple[int, ...]]]  # the dtype and shape gguf's reader gives a tensor's data

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return str(arch) if arch is not None else None

    @property
    def file_type(self) -> str | None:
        """llama.cpp's name of the file's quantization mix (`general.file_type`), e.g. MOSTLY_Q4_K_M."""
        ft = self.metadata.get("general.file_type")
        if ft is None:
            return None
        try:
            return LlamaFileType(int(ft)).name
        except (ValueError, TypeError):
            return str(ft)

    def to_json(self) -> bytes:
        return orjson.dumps({"version": INDEX_VERSION, "header": self.header, "metadata": self.metadata,
                             "tensors": [[t.name, t.type_name, list(t.shape), t.n_elements, t.n_bytes, t.offset]
                                         for t in self.tensors.values()],
                             "layouts": {k: [d, list(s)] for k, (d, s) in self.layouts.items()}})

    @classmethod
    def from_json(cls, data: bytes) -> GgufIndex:
        d = orjson.loads(data)
        if d.get("version") != INDEX_VERSION:
            raise ValueError("an index of another form")
        tensors = {t[0]: TensorInfo(t[0], t[1], tuple(t[2]), t[3], t[4], t[5]) for t in d["tensors"]}
        return cls(d["header"], d["metadata"], tensors, {k: (v[0], tuple(v[1])) for k, v in d["layouts"].items()})


# ---- reading a header with gguf's reader -----------------------------------------------------------------
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


def _value(v: Any) -> Any:
    if isinstance(v, str) and len(v) > STRING_MAX:
        return {"type": "STRING", "length": len(v), "first": v[:STRING_MAX] + "…"}
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not np.isfinite(v):
        return str(v)
    return v


def field_summary(field: Any) -> Any:
    types = list(field.types)
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        n = len(field.data)
        item_type = types[-1].name if len(types) > 1 else "UNKNOWN"
        if n <= ARRAY_FULL:
            return [_value(x) for x in field_contents(field)]
        return {"type": "ARRAY", "item_type": item_type, "length": n,
                "first": [_value(x) for x in field_contents(field, slice(0, ARRAY_HEAD))]}
    return _value(field_contents(field))


class _HeaderReader(GGUFReader):
    """gguf's reader over a copy of the header alone.  Tensor data views are shape-only placeholders
    (zero strides, no memory): the store reads tensor bytes itself, so nothing maps the file.  Only the tensor
    table's reads are swapped (an instance attribute for its span): the metadata's hundreds of thousands of
    reads go straight to gguf's own method.  The mapped header is read as a plain ndarray: numpy's memmap
    subclass costs a Python-level finalizer on every slice, most of the parse's time for a tokenizer."""

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)  # the same mapped bytes (kept alive through .base)

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        self._get = self._placeholder  # type: ignore[method-assign]
        try:
            super()._build_tensors(start_offs, fields)
        finally:
            del self._get

    @staticmethod
    def _placeholder(offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        return np.broadcast_to(np.zeros((), dtype), (int(count),))


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


def _read_header(fh: Any, size: int, max_header: int, inline_only: bool) -> GGUFReader:
    """Parse the header from a prefix of the file: as much as `max_header` allows, parsed once (a tokenizer's
    header takes seconds whatever the prefix: a parse that failed at a shorter prefix would be work lost).
    `inline_only`: the first INLINE_HEADER_BYTES alone (most headers: milliseconds), and HeaderTooLarge where the
    parse needs bytes past them (it fails or ends at their edge): the caller reads it elsewhere."""
    for prefix in (min(size, INLINE_HEADER_BYTES, max_header) if inline_only else min(size, max_header),):
        data = os.pread(fh.fileno(), prefix, 0)
        if len(data) < prefix:
            raise FileChanged("the file shrank while its header was read")
        error: Exception | None = None
        with _header_copy(data) as copy:
            try:
                with np.errstate(all="ignore"):  # hostile counts overflow numpy scalars: checked below
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
        if inline_only:
            raise HeaderTooLarge(f"the header needs more than {prefix} bytes")
    raise AssertionError("unreachable: the last prefix returns or raises")


def read_index(path: Path, file: FileId, max_header: int = DEFAULT_MAX_HEADER_BYTES,
               inline_only: bool = False) -> GgufIndex:
    """The index of the file at `path`, which must still be `file`; ValueError (or FileChanged) if it is
    broken; HeaderTooLarge where `inline_only` and the header is past INLINE_HEADER_BYTES."""
    with open(path, "rb", buffering=0) as fh:
        if FileId.of(os.fstat(fh.fileno())) != file:
            raise FileChanged("the file changed while it was opened")
        size = file.size
        if size == 0:
            raise ValueError("file is empty")
        if os.pread(fh.fileno(), 4, 0) != b"GGUF":
            raise ValueError("not a GGUF file (magic bytes are not 'GGUF')")
        reader = _read_header(fh, size, max_header, inline_only)
        if FileId.of(os.fstat(fh.fileno())) != file:
            raise FileChanged("the file changed while its header was read")
    tensors: dict[str, TensorInfo] = {}
    layouts: dict[str, tuple[str, tuple[int, ...]]] = {}
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
        layouts[t.name] = (t.data.dtype.str, tuple(int(s) for s in t.data.shape))
    f = reader.fields
    header = {"version": int(field_contents(f["GGUF.version"])),
              "tensor_count": int(field_contents(f["GGUF.tensor_count"])),
              "kv_count": int(field_contents(f["GGUF.kv_count"])),
              "alignment": int(reader.alignment), "data_offset": int(reader.data_offset),
              "byte_order": "little" if reader.byte_order == "I" else "big"}
    metadata = {k: field_summary(v) for k, v in f.items() if not k.startswith("GGUF.")}
    return GgufIndex(header, metadata, tensors, layouts)


# ---- the index of a large header: read in a child process, cached per file version ---------------------
def _child_read(path: str, file: FileId, max_header: int, cache_dir: Path | None) -> tuple[bytes | None, str | None]:
    """In the child: the index as JSON, or the reason the file cannot be read (the same text as inline).  With a
    cache, one process reads a file version while the others (a server's fronts and engine) wait for its index."""
    cache = IndexCache(cache_dir)
    lock = cache.lock(Path(path), file)
    try:
        done = cache.get(Path(path), file)
        if done is not None:
            return done.to_json(), None
        data = read_index(Path(path), file, max_header).to_json()
        cache.put(Path(path), file, data)
        return data, None
    except FileChanged:
        raise
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    finally:
        if lock is not None:
            lock.close()


_POOL: ProcessPoolExecutor | None = None
_PENDING = 0
_POOL_LOCK = threading.Lock()


def read_in_child(path: Path, file: FileId, max_header: int,
                  cache_dir: Path | None = None) -> Future[tuple[bytes | None, str | None]]:
    """Read a large header in a child process (a fresh one each time: the parse's ~20x memory goes with it,
    and the parse holds no lock the server's threads need); the pool goes when nothing is left to read."""
    global _POOL, _PENDING
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1)
        _PENDING += 1
        future = _POOL.submit(_child_read, str(path), file, max_header, cache_dir)

    def done(_: Future) -> None:
        global _POOL, _PENDING
        with _POOL_LOCK:
            _PENDING -= 1
            if _PENDING == 0 and _POOL is not None:
                _POOL.shutdown(wait=False)
                _POOL = None
    future.add_done_callback(done)
    return future


def shutdown() -> None:
    """Stop the reading child, if any (the server's shutdown): a header half read is read again next time."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.shutdown(wait=False, cancel_futures=True)
            _POOL = None


class IndexCache:
    """Indexes of large headers on disk, one file per file version (path and identity), so that a restart or a
    second process reads a tokenizer-heavy header in milliseconds.  A cache file that cannot be read is ignored;
    at most `keep` are kept (the least recently written go)."""

    def __init__(self, directory: Path | None, keep: int = 256):
        self.directory, self.keep = directory, keep

    def _path(self, path: Path, file: FileId) -> Path:
        assert self.directory is not None
        key = f"{INDEX_VERSION}\0{os.path.realpath(path)}\0{file.dev}\0{file.ino}\0{file.size}\0{file.mtime_ns}" \
              f"\0{file.ctime_ns}"
        return self.directory / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")

    def lock(self, path: Path, file: FileId) -> Any:
        """An exclusive lock on this file version's index (held until the returned file is closed), or None."""
        if self.directory is None:
            return None
        import fcntl

        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fh = open(self._path(path, file).with_suffix(".lock"), "w")
        except OSError:
            return None
        fcntl.flock(fh, fcntl.LOCK_EX)
        return fh

    def get(self, path: Path, file: FileId) -> GgufIndex | None:
        if self.directory is None:
            return None
        try:
            return GgufIndex.from_json(self._path(path, file).read_bytes())
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return None

    def put(self, path: Path, file: FileId, data: bytes) -> None:
        if self.directory is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            target = self._path(path, file)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".index-", suffix=".part")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, target)
            entries = sorted(self.directory.glob("*.json"), key=lambda p: p.stat().st_mtime)
            for old in entries[:-self.keep]:
                old.unlink(missing_ok=True)
                old.with_suffix(".lock").unlink(missing_ok=True)
        except OSError:  # a read-only or full cache: the next start reads the header again
            pass
