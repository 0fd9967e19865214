"""Independent check of a safetensors file written by tests/test_safetensors.c
(test_numpy): parses it with json + numpy only, checks the layout rules of
formats.md 1.2/1.3 and the tensor values, which must match the formulas in
test_numpy. Usage: python3 tests/safetensors_numpy_check.py FILE; exit 0 if
all is well, 1 with a message otherwise."""
import json
import struct
import sys

import numpy as np

DTYPES = {"BOOL": "|b1", "U8": "|u1", "I8": "|i1", "I16": "<i2", "U16": "<u2", "F16": "<f2",
          "BF16": "<u2", "I32": "<i4", "U32": "<u4", "F32": "<f4", "F64": "<f8", "I64": "<i8", "U64": "<u8"}


def no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("duplicate key in header")
    return dict(pairs)


def load(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0, f"header length {n} is not a multiple of 8"
    text = raw[8:8 + n].decode("utf-8")
    assert text[0] == "{", "header must start with '{'"
    body = text.rstrip(" ")
    header = json.loads(body, object_pairs_hook=no_duplicates)
    meta = header.pop("__metadata__", {})
    buf = raw[8 + n:]
    entries = sorted(header.items(), key=lambda kv: (kv[1]["data_offsets"][0], kv[1]["data_offsets"][1]))
    pos, tensors, prev = 0, {}, None
    for name, e in entries:
        assert set(e) == {"dtype", "shape", "data_offsets"}, f"{name}: fields {sorted(e)}"
        dt = np.dtype(DTYPES[e["dtype"]])
        begin, end = e["data_offsets"]
        assert begin == pos, f"{name}: begins at {begin}, expected {pos}"
        count = int(np.prod(e["shape"], dtype=np.int64))
        assert end - begin == count * dt.itemsize, f"{name}: offsets do not match shape"
        assert (8 + n + begin) % dt.itemsize == 0, f"{name}: not naturally aligned"
        # writer order: decreasing element size, then name
        if prev is not None:
            assert (prev[1] > dt.itemsize) or (prev[1] == dt.itemsize and prev[0] < name), f"order: {prev[0]} before {name}"
        prev = (name, dt.itemsize)
        a = np.frombuffer(buf[begin:end], dtype=dt).reshape(e["shape"])
        if e["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = (e["dtype"], a)
        pos = end
    assert pos == len(buf), f"data buffer has {len(buf)} bytes, tensors cover {pos}"
    return meta, tensors


def main():
    meta, t = load(sys.argv[1])
    i = np.arange
    expect = {
        "f32.ramp": ("F32", (0.25 * i(12, dtype=np.float32) - 1.5).astype(np.float32).reshape(3, 4)),
        "i32.ramp": ("I32", (i(5, dtype=np.int64) * 1000003 - 7).astype(np.int32)),
        "u8.ramp": ("U8", ((i(300) * 7) % 256).astype(np.uint8)),
        "bf16.vals": ("BF16", np.array([1.0, -2.5, 0.15625, 65536.0], dtype=np.float32)),
        "f16.vals": ("F16", np.array([1.0, -0.5, 2048.0], dtype=np.float16)),
        "f64.scalar": ("F64", np.array(3.141592653589793)),
        "i64.big": ("I64", np.array([2**40 + 1, -2**53, 2**62], dtype=np.int64)),
        "empty": ("F32", np.zeros((0, 3), dtype=np.float32)),
    }
    assert set(t) == set(expect), f"tensors {sorted(t)}"
    for name, (dtype, want) in expect.items():
        got_dtype, got = t[name]
        assert got_dtype == dtype, f"{name}: dtype {got_dtype}, expected {dtype}"
        assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
        assert np.array_equal(got, want), f"{name}: values {got}, expected {want}"
    want_meta = {"format_version": "1", "note": "quote \" backslash \\ newline \n \u00e9"}
    assert meta == want_meta, f"metadata {meta!r}"
    print(f"  numpy cross-check: {len(t)} tensors and metadata match")


if __name__ == "__main__":
    try:
        main()
    except (AssertionError, ValueError, KeyError) as err:
        print(f"  numpy cross-check FAILED: {err}")
        sys.exit(1)
