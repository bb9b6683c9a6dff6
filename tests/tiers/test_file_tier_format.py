"""The chunk file header: pure byte layout and its checksum, no files."""

from __future__ import annotations

import mmap

import crc32c
import pytest

from offload.tiers.file_format import (
    FIXED_BYTES,
    FORMAT_VERSION,
    FormatError,
    Header,
    file_name,
    geometry_fingerprint,
    key_bytes,
    max_key_bytes,
    pack_header,
    unpack_header,
)

PAGE = 4096
CRC = crc32c.crc32c


def _header(key: object = ("seq", 7, b"\x01")) -> Header:
    return Header(PAGE, 1 << 20, 0xDEADBEEF, 42, geometry_fingerprint({"slot": 1}),
                  key_bytes(key))


def _packed(header: Header) -> memoryview:
    page = memoryview(mmap.mmap(-1, PAGE))
    page[:] = b"\xff" * PAGE  # padding must be zeroed by pack_header, not inherited
    pack_header(page, header, CRC)
    return page


def test_header_round_trips_and_is_zero_padded() -> None:
    header = _header()
    page = _packed(header)
    assert unpack_header(page, CRC) == header
    assert bytes(page[FIXED_BYTES + len(header.key):]) == bytes(PAGE - FIXED_BYTES
                                                                - len(header.key))


@pytest.mark.parametrize("offset", [0, 9, 12, 17, 24, 27, 28, 31, 33, 45, 75, 80, 200, PAGE - 1])
def test_any_flipped_header_byte_is_detected(offset: int) -> None:
    page = _packed(_header())
    page[offset] ^= 0x10
    with pytest.raises(FormatError):
        unpack_header(page, CRC)


def test_other_version_and_foreign_bytes_are_rejected_with_a_reason() -> None:
    page = _packed(_header())
    other = FORMAT_VERSION + 1  # header checksum not recomputed: the version check says why
    page[8] = other
    with pytest.raises(FormatError, match=f"format version {other}"):
        unpack_header(page, CRC)
    with pytest.raises(FormatError, match="bad magic"):
        unpack_header(memoryview(bytearray(PAGE)), CRC)
    with pytest.raises(FormatError, match="shorter"):
        unpack_header(memoryview(bytearray(10)), CRC)


def test_key_must_fit_the_page() -> None:
    header = _header()
    longest = Header(PAGE, 1, 0, 0, header.fingerprint, b"k" * max_key_bytes(PAGE))
    assert unpack_header(_packed(longest), CRC).key == longest.key
    too_long = Header(PAGE, 1, 0, 0, header.fingerprint, b"k" * (max_key_bytes(PAGE) + 1))
    with pytest.raises(ValueError, match="does not fit"):
        _packed(too_long)


def test_fingerprint_ignores_key_order_and_sees_every_value() -> None:
    a = geometry_fingerprint({"slot_bytes": 65536, "tp": 2, "pp": 1})
    assert a == geometry_fingerprint({"pp": 1, "tp": 2, "slot_bytes": 65536})
    assert a != geometry_fingerprint({"slot_bytes": 65536, "tp": 2, "pp": 2})
    assert len(a) == 32


def test_file_names_are_stable_hashes_of_the_key_repr() -> None:
    name = file_name(key_bytes((1, b"ab")))
    assert name == file_name(key_bytes((1, b"ab"))) != file_name(key_bytes((1, b"ac")))
    assert name.endswith(".kv") and len(name) == 43 and "/" not in name
