"""Reading and writing IDX files, the format MNIST ships in (optionally gzipped). Needs only numpy."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path
from typing import Any, Final

import numpy as np

# IDX type codes (third byte of the magic number) and the numpy dtypes they stand for (big-endian).
_DTYPES: Final[dict[int, str]] = {
    0x08: ">u1",
    0x09: ">i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}
_CODES: Final[dict[str, int]] = {np.dtype(v).str: k for k, v in _DTYPES.items()}


class IdxFormatError(ValueError):
    """The bytes are not a well-formed IDX file."""


def parse_idx(data: bytes) -> np.ndarray[Any, Any]:
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise IdxFormatError("missing the IDX magic number (two zero bytes, a type code, a rank)")
    type_code, ndim = data[2], data[3]
    if type_code not in _DTYPES:
        raise IdxFormatError(f"unknown IDX type code 0x{type_code:02x}")
    header_end = 4 + 4 * ndim
    if len(data) < header_end:
        raise IdxFormatError("truncated IDX header")
    shape = struct.unpack(f">{ndim}I", data[4:header_end])
    dtype = np.dtype(_DTYPES[type_code])
    count = int(np.prod(shape)) if shape else 1
    if len(data) - header_end != count * dtype.itemsize:
        raise IdxFormatError(
            f"IDX payload has {len(data) - header_end} bytes, shape {shape} needs {count * dtype.itemsize}"
        )
    return np.frombuffer(data, dtype=dtype, offset=header_end).reshape(shape)


def read_idx(path: Path) -> np.ndarray[Any, Any]:
    """An IDX file as an array; ``.gz`` files are decompressed."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return parse_idx(raw)


def encode_idx(array: np.ndarray[Any, Any]) -> bytes:
    big_endian = array.astype(array.dtype.newbyteorder(">"), copy=False)
    code = _CODES.get(big_endian.dtype.str)
    if code is None:
        raise IdxFormatError(f"no IDX type code for dtype {array.dtype}")
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + big_endian.tobytes()


def write_idx(path: Path, array: np.ndarray[Any, Any]) -> None:
    data = encode_idx(array)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
