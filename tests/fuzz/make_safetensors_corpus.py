#!/usr/bin/env python3
"""Writes the seed corpus of the safetensors fuzz target (tests/fuzz/corpus/safetensors/): valid/
files moefold-upcycle must accept (run as --activation relu --experts 2 --topk 2 --world 1) and
invalid/ files, each breaking one rule, that it must refuse with exit 2. Run it from anywhere;
the corpus is committed, so this only documents how each file was made.
Usage: make_safetensors_corpus.py"""
import json
import pathlib
import struct

root = pathlib.Path(__file__).resolve().parent / "corpus" / "safetensors"
SIZE = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I32": 4}


def file_bytes(entries, data=None, pad=0, metadata=None, raw_header=None, length=None):
    """entries: [(name, dtype, shape)] laid out in order; returns the file's bytes."""
    header, blob, at = {}, b"", 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape in entries:
        n = SIZE[dtype] if dtype in SIZE else 4
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        blob += bytes((at + k) % 251 for k in range(n)) if dtype != "F32" else \
            b"".join(struct.pack("<f", ((at + k) % 13 - 6) / 8) for k in range(n // 4))
        at += n
    text = raw_header if raw_header is not None else json.dumps(header).encode() + b" " * pad
    return struct.pack("<Q", len(text) if length is None else length) + text + \
        (blob if data is None else data)


def layer(i, dtype="F32", h=3, f=4, gated=False):
    p = f"model.layers.{i}.mlp."
    return ([(p + "gate_proj.weight", dtype, [f, h])] if gated else []) + \
        [(p + "up_proj.weight", dtype, [f, h]), (p + "down_proj.weight", dtype, [h, f])]


valid = {
    "one-layer-f32": file_bytes(layer(0) + [("model.norm.weight", "F32", [3])],
                                metadata={"format": "pt"}),
    "two-layers-bf16": file_bytes(layer(0, "BF16", 2, 6) + layer(1, "BF16", 2, 6)),
    "padded-header-empty-tensor": file_bytes(
        [("model.layers.0.input_layernorm.weight", "F32", [0])] + layer(0, "F16", 4, 2), pad=7),
    "biases-f32": file_bytes(layer(0) + [("model.layers.0.mlp.up_proj.bias", "F32", [4]),
                                         ("model.layers.0.mlp.down_proj.bias", "F32", [3])]),
    "f64-attention-too": file_bytes([("model.layers.0.self_attn.q_proj.weight", "F32", [3, 3])] +
                                    layer(0, "F64", 3, 2)),
}
good = valid["one-layer-f32"]
gl = len(json.dumps({}))
invalid = {
    "truncated-data": good[:-3],
    "shorter-than-length": good[:5],
    "length-past-end": struct.pack("<Q", 1 << 40) + good[8:],
    "length-zero": struct.pack("<Q", 0) + good[8:],
    "not-json": file_bytes([], raw_header=b"{not json}", data=b""),
    "json-array": file_bytes([], raw_header=b"[1, 2]", data=b""),
    "unknown-dtype": file_bytes([("model.layers.0.mlp.up_proj.weight", "Q7", [1])]),
    "int-weights": file_bytes(layer(0, "I32")),
    "gap": file_bytes(layer(0), raw_header=json.dumps({
        "model.layers.0.mlp.up_proj.weight": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]},
        "model.layers.0.mlp.down_proj.weight": {"dtype": "F32", "shape": [3, 4],
                                                "data_offsets": [52, 100]}}).encode(),
        data=bytes(100)),
    "overlap": file_bytes(layer(0), raw_header=json.dumps({
        "model.layers.0.mlp.up_proj.weight": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]},
        "model.layers.0.mlp.down_proj.weight": {"dtype": "F32", "shape": [3, 4],
                                                "data_offsets": [40, 88]}}).encode(),
        data=bytes(88)),
    "trailing-bytes": good + b"\0\0\0\0",
    "shape-disagrees-with-offsets": file_bytes(layer(0), raw_header=json.dumps({
        "model.layers.0.mlp.up_proj.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 48]},
        "model.layers.0.mlp.down_proj.weight": {"dtype": "F32", "shape": [3, 4],
                                                "data_offsets": [48, 96]}}).encode()),
    "duplicate-name": file_bytes([], raw_header=(
        b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
        b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}'), data=bytes(8)),
    "negative-offset": file_bytes([], raw_header=(
        b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}'), data=b""),
    "shape-not-array": file_bytes([], raw_header=(
        b'{"a": {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}}'), data=bytes(4)),
    "metadata-not-strings": file_bytes(layer(0), metadata={"n": 1}),
    "no-down-proj": file_bytes(layer(0)[:1]),
    "no-layers": file_bytes([("model.norm.weight", "F32", [3])]),
    "up-proj-3d": file_bytes([("model.layers.0.mlp.up_proj.weight", "F32", [2, 2, 3]),
                              ("model.layers.0.mlp.down_proj.weight", "F32", [3, 4])]),
    "down-proj-wrong-shape": file_bytes([("model.layers.0.mlp.up_proj.weight", "F32", [4, 3]),
                                         ("model.layers.0.mlp.down_proj.weight", "F32", [4, 3])]),
    "gated-under-relu": file_bytes(layer(0, gated=True)),
    "bias-wrong-shape": file_bytes(layer(0) + [("model.layers.0.mlp.down_proj.bias", "F32", [4])]),
    "unknown-entry-member": file_bytes([], raw_header=(
        b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 0}}'), data=bytes(4)),
    "deep-nesting": file_bytes([], raw_header=b'{"__metadata__": ' + b"[" * 200 + b"]" * 200 + b"}",
                               data=b""),
}
for kind, files in (("valid", valid), ("invalid", invalid)):
    (root / kind).mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (root / kind / f"{name}.safetensors").write_bytes(data)
print(f"{len(valid)} valid and {len(invalid)} invalid files in {root}")
