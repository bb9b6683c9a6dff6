"""The on-disk format of the file tier: pure byte layout, no I/O.

A chunk file is one header page followed by the payload (one host row's bytes):

=========  ======  ==============================================================
offset     type    field
=========  ======  ==============================================================
0          8s      magic ``b"OFFLDKV\\0"``
8          u16     format version (`FORMAT_VERSION`)
10         u16     reserved, 0
12         u32     header bytes (the page the payload starts after)
16         u64     payload bytes
24         u32     crc32c of the payload
28         u32     crc32c of the whole header page except these four bytes
32         u64     sequence number (write order; rebuilds the LRU after a restart)
40         32s     geometry fingerprint (sha256 digest)
72         u32     key length
76         ...     the key: ``repr(chunk_key)`` in UTF-8; zero padding to the page
=========  ======  ==============================================================

Little-endian throughout.  The header is padded to a whole page so the payload starts at a
page-aligned file offset and the header plus the caller's row go to disk in one ``O_DIRECT``
``pwritev``.  The header checksum covers the padding too, so every byte of the file is
checked.  A file's name is a hash of the key (`file_name`); the key itself is stored and
compared on read, so a hash collision is a miss, never another key's bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

MAGIC = b"OFFLDKV\0"
FORMAT_VERSION = 1
SUFFIX = ".kv"
_FIXED = struct.Struct("<8sHHIQIIQ32sI")
_HEADER_CRC_AT = 28  # offset of the header checksum, excluded from its own computation
FIXED_BYTES = _FIXED.size  # 76

Crc = Callable[..., int]  # crc32c.crc32c(data, value=0) -> int


class FormatError(ValueError):
    """A header that is not a valid chunk file header of this tier (the file is a miss)."""


@dataclass(frozen=True)
class Header:
    """The fields of one chunk file's header (see the module docstring)."""

    header_bytes: int
    payload_bytes: int
    payload_crc: int
    seq: int
    fingerprint: bytes
    key: bytes


def geometry_fingerprint(geometry: Mapping[str, object]) -> bytes:
    """A sha256 digest of the geometry, independent of key order.  Every value must be JSON
    serialisable (ints, strings, lists, nested mappings); two geometries that differ in any
    value get different fingerprints."""
    text = json.dumps(dict(geometry), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).digest()


def key_bytes(key: Hashable) -> bytes:
    """The stored form of a chunk key: its ``repr`` in UTF-8.  Keys must have a repr that is
    the same in every process (ints, bytes, strings and tuples of them do; objects whose repr
    shows an address do not)."""
    return repr(key).encode()


def file_name(key: bytes) -> str:
    """The file name of a key: a hash, so any key maps to a short, safe name."""
    return hashlib.sha256(key).hexdigest()[:40] + SUFFIX


def chunk_file_bytes(row_bytes: int, page_size: int) -> int:
    """Disk bytes of one chunk file: a header page plus the row.  A plan that wants the same
    number of files on every rank gives each ``capacity x chunk_file_bytes(its row)``."""
    return page_size + row_bytes


def max_key_bytes(header_bytes: int) -> int:
    """The longest key a header of ``header_bytes`` can store."""
    return header_bytes - FIXED_BYTES


def pack_header(page: memoryview, header: Header, crc: Crc) -> None:
    """Write ``header`` into ``page`` (its whole length is the header, zero padded) and seal
    it with the header checksum, computed in place without copying the page."""
    if len(page) != header.header_bytes:
        raise ValueError(f"header page is {len(page)} bytes, expected {header.header_bytes}")
    if len(header.key) > max_key_bytes(header.header_bytes):
        raise ValueError(f"key of {len(header.key)} bytes does not fit a "
                         f"{header.header_bytes}-byte header")
    _FIXED.pack_into(page, 0, MAGIC, FORMAT_VERSION, 0, header.header_bytes,
                     header.payload_bytes, header.payload_crc, 0, header.seq,
                     header.fingerprint, len(header.key))
    end = FIXED_BYTES + len(header.key)
    page[FIXED_BYTES:end] = header.key
    page[end:] = bytes(len(page) - end)
    struct.pack_into("<I", page, _HEADER_CRC_AT, header_crc(page, crc))


def unpack_header(page: memoryview, crc: Crc) -> Header:
    """Parse and verify a header page; FormatError says what is wrong."""
    if len(page) < FIXED_BYTES:
        raise FormatError(f"header of {len(page)} bytes is shorter than {FIXED_BYTES}")
    (magic, version, _reserved, header_bytes, payload_bytes, payload_crc, stored_crc, seq,
     fingerprint, key_len) = _FIXED.unpack_from(page, 0)
    if magic != MAGIC:
        raise FormatError("not a chunk file (bad magic)")
    if version != FORMAT_VERSION:
        raise FormatError(f"format version {version}, this tier reads {FORMAT_VERSION}")
    if header_bytes != len(page):
        raise FormatError(f"header of {header_bytes} bytes, this tier uses {len(page)}")
    if key_len > max_key_bytes(header_bytes):
        raise FormatError(f"key length {key_len} overruns the header")
    if header_crc(page, crc) != stored_crc:
        raise FormatError("header checksum mismatch")
    key = bytes(page[FIXED_BYTES:FIXED_BYTES + key_len])
    return Header(header_bytes, payload_bytes, payload_crc, seq, fingerprint, key)


def header_crc(page: memoryview, crc: Crc) -> int:
    """crc32c of the header page without its own checksum field, chained over the two parts
    (no copy, no zeroing)."""
    head = crc(page[:_HEADER_CRC_AT])
    return int(crc(page[_HEADER_CRC_AT + 4:], head))
