"""A reader of safetensors files (the format: an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the data), enough for the files moefold's
tools write; strict about what it reads (ranges inside the data, byte counts that match)."""
import json
import struct

import torch

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32}


def read(path):
    """{name: tensor} of the file at `path` (CPU tensors, copied out of the file)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError(f"{path}: the header length {n} runs past the end of the file")
    try:
        header = json.loads(raw[8:8 + n])
    except ValueError as e:
        raise ValueError(f"{path}: the header is not JSON ({e})") from None
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _DTYPES.get(info.get("dtype"))
        if dt is None:
            raise ValueError(f"{path}: tensor {name}: dtype {info.get('dtype')!r} is not read "
                             f"(known: {sorted(_DTYPES)})")
        begin, end = info["data_offsets"]
        shape = list(info["shape"])
        count = 1
        for s in shape:
            count *= s
        if not 0 <= begin <= end <= len(data) or end - begin != count * dt.itemsize:
            raise ValueError(f"{path}: tensor {name}: bytes [{begin}, {end}) do not hold "
                             f"{shape} of {info['dtype']} inside the data")
        out[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=dt).reshape(shape) \
            if count else torch.empty(shape, dtype=dt)
    return out
