"""Cut a GGUF down to some of its tensors (metadata kept), with gguf's reader and writer: e.g. one
layer to ship to a GPU machine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from models.atomic import atomic_file


def cut(src: Path, dst: Path, names: list[str]) -> Path:
    reader = GGUFReader(src)
    tensors = {t.name: t for t in reader.tensors}
    missing = [n for n in names if n not in tensors]
    if missing:
        raise KeyError(f"{src.name} has no tensor(s) {', '.join(missing)}")
    arch = str(reader.fields["general.architecture"].contents()) if "general.architecture" in reader.fields else "?"
    dst = Path(dst)
    with atomic_file(dst, "cut") as (_, tmp):
        writer = GGUFWriter(tmp, arch=arch)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            vtype = field.types[0]
            sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
        for n in names:
            t = tensors[n]
            qtype = GGMLQuantizationType(int(t.tensor_type))
            data = np.asarray(t.data)
            if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                writer.add_tensor(n, data)
            else:
                writer.add_tensor(n, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return dst
