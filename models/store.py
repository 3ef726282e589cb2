"""The model store: every *.gguf in the models directory, opened with gguf's reader.

Files are memory-mapped; a model's id is its file name without `.gguf`.  A file that cannot be
read, or whose header contradicts itself, is listed with status "error" and never breaks the
others.  Requests name models and tensors by id and are answered only from what a scan found,
so no request can reach a path outside the directory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from kernels.formats import FORMATS, MATMUL_TYPES


class NotFound(LookupError):
    pass


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
    size_bytes: int
    mtime_ns: int
    status: str = "ok"
    error: str | None = None
    reader: GGUFReader | None = None
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def version_key(self) -> tuple[str, int, int]:
        """Identifies this exact file; caches of derived data key on it."""
        return (self.id, self.size_bytes, self.mtime_ns)

    @property
    def architecture(self) -> str | None:
        if self.reader is None:
            return None
        f = self.reader.fields.get("general.architecture")
        return str(f.contents()) if f is not None else None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (or values for F32/F16), as the reader maps them: no copy."""
        assert self.reader is not None
        return self.reader.tensors[self._index[name]].data

    _index: dict[str, int] = field(default_factory=dict, repr=False)


def _open(path: Path, model: Model) -> None:
    if model.size_bytes == 0:
        raise ValueError("file is empty")
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ValueError("not a GGUF file (magic bytes are not 'GGUF')")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # gguf raises IndexError, ValueError, ... on cut or garbled headers
        raise ValueError(f"corrupt or truncated GGUF ({type(exc).__name__}: {exc})") from exc
    tensors: dict[str, TensorInfo] = {}
    index: dict[str, int] = {}
    for i, t in enumerate(reader.tensors):
        ttype = GGMLQuantizationType(int(t.tensor_type))
        shape = tuple(int(s) for s in reversed([int(x) for x in t.shape]))
        n_el = int(t.n_elements)
        if int(np.prod(shape, dtype=np.int64)) != n_el:
            raise ValueError(f"tensor {t.name!r}: shape {shape} does not hold {n_el} elements")
        end = int(t.data_offset) + int(t.n_bytes)
        if end > model.size_bytes:
            raise ValueError(f"tensor {t.name!r} ends at byte {end}, past the end of the file "
                             f"({model.size_bytes} bytes): truncated?")
        fmt = FORMATS.get(ttype)
        if fmt is not None and len(shape) >= 1 and shape[-1] % fmt.block_values:
            raise ValueError(f"tensor {t.name!r}: row of {shape[-1]} is not whole {fmt.name} blocks")
        tensors[t.name] = TensorInfo(t.name, ttype.name, shape, n_el, int(t.n_bytes), int(t.data_offset))
        index[t.name] = i
    model.reader, model.tensors, model._index = reader, tensors, index


class ModelStore:
    def __init__(self, models_dir: Path):
        self.models_dir = Path(models_dir)
        self._models: dict[str, Model] = {}
        self._lock = threading.Lock()

    def scan(self) -> list[Model]:
        """Re-read the directory; files unchanged since the last scan keep their open reader."""
        with self._lock:
            found: dict[str, Model] = {}
            paths = sorted(self.models_dir.glob("*.gguf")) if self.models_dir.is_dir() else []
            for path in paths:
                try:
                    st = path.stat()
                except OSError:
                    continue  # vanished or a broken link
                if not path.is_file():
                    continue
                model_id = path.name[: -len(".gguf")]
                old = self._models.get(model_id)
                if old and (old.size_bytes, old.mtime_ns, old.path) == (st.st_size, st.st_mtime_ns, path):
                    found[model_id] = old
                    continue
                model = Model(model_id, path, st.st_size, st.st_mtime_ns)
                try:
                    _open(path, model)
                except Exception as exc:  # any way a file can be broken: list it, keep the others
                    model.status, model.error = "error", f"{type(exc).__name__}: {exc}"
                    model.reader, model.tensors = None, {}
                found[model_id] = model
            self._models = found
            return list(found.values())

    def get(self, model_id: str) -> Model:
        model = self._models.get(model_id)
        if model is None:
            self.scan()
            model = self._models.get(model_id)
        if model is None:
            raise NotFound(f"model {model_id!r} not found; known models: {', '.join(sorted(self._models))}")
        return model

    def tensor(self, model_id: str, name: str) -> tuple[Model, TensorInfo]:
        model = self.get(model_id)
        if model.status != "ok":
            raise NotFound(f"model {model_id!r} could not be read: {model.error}")
        info = model.tensors.get(name)
        if info is None:
            raise NotFound(f"tensor {name!r} not found in model {model_id!r}")
        return model, info

