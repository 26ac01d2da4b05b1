"""A GGUF file's header: its key-value fields and its tensors' names and types, without the data.

What :func:`specforge.engines.llamacpp.gguf_spec_type` (every ``LlamaServer`` with a draft) and the AMX
check need to know about a GGUF. gguf-py's ``GGUFReader`` parses every element of every array field
into numpy views, the tokenizer's ~100k strings included: 2.3 s for a SmolLM2 draft on a 2-core EPYC,
twice per server start. Here array fields are skipped by their lengths (a few ms); numbers, booleans
and strings are read, and numeric arrays of at most :data:`SMALL_ARRAY` elements (layer ids).

Format (GGUF v2/v3, little-endian; ggml's ``docs/gguf.md``): magic ``GGUF``, uint32 version, uint64
tensor count, uint64 field count; each field a string key, a uint32 value type and the value; then
each tensor's name, uint32 n_dims, n_dims x uint64 dims, uint32 ggml type, uint64 offset. A string is
a uint64 length and its UTF-8 bytes; an array a uint32 element type, a uint64 count and the elements.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any, Optional

SMALL_ARRAY = 1024  # numeric arrays up to this many elements are read; longer ones (and string arrays) skipped

# GGUF value types: struct format of the fixed-size ones (uint8 .. float64); 8 = string, 9 = array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufHeader:
    version: int
    fields: dict[str, Any]  # skipped arrays hold None
    tensors: tuple[tuple[str, int], ...]  # (name, ggml type number) in file order

    @property
    def architecture(self) -> Optional[str]:
        arch = self.fields.get("general.architecture")
        return arch if isinstance(arch, str) else None


class _Cursor:
    def __init__(self, buf):
        self.buf, self.at = buf, 0

    def unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.at + n > len(self.buf):
            raise ValueError("string past the end of the file")
        text = bytes(self.buf[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def skip_strings(self, count: int) -> None:  # value() checks where this ends
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", self.buf, self.at)
            self.at += 8 + n

    def value(self, kind: int):
        if kind in _SCALAR:
            return self.unpack(_SCALAR[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item in _SCALAR:
            size = struct.calcsize(_SCALAR[item])
            if count <= SMALL_ARRAY:
                out = list(struct.unpack_from(f"<{count}{_SCALAR[item][1]}", self.buf, self.at))
                self.at += count * size
                return out
            self.at += count * size
        elif item == _STRING:
            self.skip_strings(count)
        else:  # nested arrays: no converter of ours writes them
            raise ValueError(f"GGUF array of type {item} is not read here")
        if self.at > len(self.buf):
            raise ValueError("array past the end of the file")
        return None


def read_gguf_header(path: str) -> GgufHeader:
    """The header of the GGUF at ``path``; ValueError when it is not a GGUF (v2/v3, little-endian) or cut short."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise ValueError(f"{path!r} is empty, not a GGUF") from None
    with buf:
        cur = _Cursor(buf)
        try:
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError("no GGUF magic")
            cur.at = 4
            version = cur.unpack("<I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (little-endian v2/v3 are read)")
            n_tensors, n_fields = cur.unpack("<Q"), cur.unpack("<Q")
            fields = {}
            for _ in range(n_fields):
                key = cur.string()
                fields[key] = cur.value(cur.unpack("<I"))
            tensors = []
            for _ in range(n_tensors):
                name = cur.string()
                n_dims = cur.unpack("<I")
                cur.at += 8 * n_dims
                tensors.append((name, cur.unpack("<I")))
                cur.at += 8  # the data offset
        except struct.error:
            raise ValueError(f"{path!r} is cut short: its GGUF header ends past the end of the file") from None
        except ValueError as e:
            raise ValueError(f"{path!r} is not a readable GGUF: {e}") from None
    return GgufHeader(version, fields, tuple(tensors))
