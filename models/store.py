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
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from models.gguf_index import (
    DEFAULT_MAX_HEADER_BYTES,
    FileChanged,
    FileId,
    GgufIndex,
    HeaderTooLarge,
    IndexCache,
    TensorInfo,
    read_in_child,
    read_index,
)

__all__ = ["DEFAULT_MAX_HEADER_BYTES", "FileChanged", "FileId", "Model", "ModelStore", "NotFound", "TensorInfo",
           "Unreadable"]
log = logging.getLogger("qgemm")
LOADING_WAIT_S = 300.0  # longest a request waits for a large header being read (a tokenizer: ~10 s)


class NotFound(LookupError):
    pass


class Unreadable(LookupError):
    """The model's file is there, but it cannot be read (its status is "error"): what every route answers 409."""


@dataclass
class Model:
    id: str
    path: Path
    file: FileId
    status: str = "ok"  # "ok", "error", or "loading" while a large header is read in the background
    error: str | None = None
    index: GgufIndex | None = None
    loaded: Future[Model] | None = field(default=None, repr=False)  # while loading: the model it becomes

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return self.index.tensors if self.index is not None else {}

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
        return self.index.architecture if self.index is not None else None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (values for F32/F16) in the shape gguf's reader gives them, read from the
        file now; FileChanged if the file is no longer the one the table was read from."""
        info = self.tensors[name]
        assert self.index is not None
        dtype, shape = self.index.layouts[name]
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
        return out.view(np.dtype(dtype)).reshape(shape)


class ModelStore:
    def __init__(self, models_dir: Path, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                 on_retire: Callable[[Model], None] | None = None, cache_dir: Path | None = None,
                 background: bool = False):
        """`cache_dir`: where indexes of large headers are kept per file version (None: nowhere).
        `background`: read a header past the first 256 KiB in a child process while the model is listed as
        "loading" (the server: nothing waits on a tokenizer but the requests for that model); else here."""
        self.models_dir = Path(models_dir)
        self.max_header_bytes = max_header_bytes
        self.on_retire = on_retire  # told of each version that is replaced or removed
        self.cache = IndexCache(cache_dir)
        self.background = background
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
            file = FileId.of(st)
            if old is not None and old.path == path and old.file == file:
                done = old.loaded is not None and old.loaded.done()
                return old.loaded.result() if done else old  # type: ignore[union-attr]
            model = Model(model_id, path, file, index=self.cache.get(path, file))
            if model.index is not None:
                return model
            try:
                model.index = read_index(path, file, self.max_header_bytes, inline_only=self.background)
            except HeaderTooLarge:
                return self._read_in_background(model)
            except FileChanged:
                continue
            except Exception as exc:  # any way a file can be broken: list it, keep the others
                model.status, model.error = "error", f"{type(exc).__name__}: {exc}"
                return model
            if model.index.header["data_offset"] > (256 << 10):  # read slowly here (a tool): the server won't
                self.cache.put(path, file, model.index.to_json())
            return model
        model.status, model.error = "error", "FileChanged: the file kept changing while it was read"
        return model

    def _read_in_background(self, model: Model) -> Model:
        """List `model` as loading while a child process reads its header; then put the result in its place."""
        model.status, model.loaded = "loading", Future()
        log.info("model %s: reading its %s MiB file's header in the background", model.id, model.file.size >> 20)
        t0 = time.perf_counter()

        def done(child: Future) -> None:
            new = Model(model.id, model.path, model.file)
            try:
                data, error = child.result()
            except Exception as exc:  # FileChanged (the next look reads it again), or the child died
                data, error = None, f"{type(exc).__name__}: {exc}"
            if data is not None:
                new.index = GgufIndex.from_json(data)  # the child kept it in the cache
                log.info("model %s: %d tensors, header read in %.1f s", model.id, len(new.tensors),
                         time.perf_counter() - t0)
            else:
                new.status, new.error = "error", error
                log.warning("model %s: %s", model.id, error)
            with self._lock:
                if self._models.get(model.id) is model:
                    self._models[model.id] = new
            model.loaded.set_result(new)  # type: ignore[union-attr]

        read_in_child(model.path, model.file, self.max_header_bytes, self.cache.directory).add_done_callback(done)
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
        if model.status == "loading":
            return None  # `get` waits for it, on a thread
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
        if model.loaded is not None:  # a large header being read: this request waits for it, no other does
            model = model.loaded.result(LOADING_WAIT_S)
        return model

    def read_file(self, path: Path) -> Model | None:
        """The model in one file of the directory, read now (whatever its header's size), or None if there is
        none; nothing else in the directory is read."""
        return self._read(path.name[: -len(".gguf")], path, None)

    def settled(self, timeout: float = LOADING_WAIT_S) -> list[Model]:
        """Every model, once none is still loading (tools and tests that need every table)."""
        models = self.scan()
        for m in models:
            if m.loaded is not None:
                m.loaded.result(timeout)
        return self.scan()

    @staticmethod
    def tensor_of(model: Model, name: str) -> tuple[Model, TensorInfo]:
        if model.status != "ok":
            raise Unreadable(f"model {model.id!r} could not be read: {model.error}")
        info = model.tensors.get(name)
        if info is None:
            raise NotFound(f"tensor {name!r} not found in model {model.id!r}")
        return model, info
