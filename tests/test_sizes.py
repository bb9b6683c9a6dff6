import pytest
from hypothesis import given
from hypothesis import strategies as st

from offload.bounds import MAX_INT
from offload.errors import OffloadError
from offload.sizes import format_size, parse_size, round_up

BINARY = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}
DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


@pytest.mark.parametrize(("text", "expected"), [
    ("4096", 4096), ("64KiB", 64 << 10), ("256MiB", 256 << 20), ("4GiB", 4 << 30),
    ("1TiB", 1 << 40), ("2GB", 2 * 10**9), (" 64 kib ", 64 << 10), ("0.5KiB", 512),
    ("1.5GiB", 3 << 29), ("7b", 7), ("0", 0),
])
def test_documented_forms(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@given(st.integers(0, 4095), st.sampled_from(sorted({**BINARY, **DECIMAL})),
       st.sampled_from([str.lower, str.upper, lambda s: s]))
def test_whole_numbers_in_any_unit_and_case(n: int, unit: str, case: object) -> None:
    text = f"{n}{case(unit)}"  # type: ignore[operator]
    assert parse_size(text) == n * {**BINARY, **DECIMAL}[unit]


@given(st.integers(0, 1 << 62))
def test_ints_pass_through(n: int) -> None:
    assert parse_size(n) == n


@given(st.integers(1 << 53, MAX_INT))
def test_large_byte_counts_are_exact(n: int) -> None:
    assert parse_size(str(n)) == n


@given(st.integers(MAX_INT + 1, 1 << 70))
def test_a_size_past_what_a_file_offset_holds_is_one_line(n: int) -> None:
    """Such a size used to pass, and fail later in mmap or ftruncate with OverflowError."""
    for given_as in (n, str(n)):
        with pytest.raises(OffloadError, match="is above the largest size, "
                                               f"{MAX_INT} B .*; give a smaller size"):
            parse_size(given_as, "--cpu-bytes")


@pytest.mark.parametrize("value", [True, 1.5, None])
def test_a_size_of_another_type_is_one_line(value: object) -> None:
    with pytest.raises(OffloadError, match="is a .*, not a size"):
        parse_size(value, "--cpu-bytes")  # type: ignore[arg-type]


def test_exact_decimal_sizes() -> None:
    assert parse_size("4.1GB") == 4_100_000_000
    with pytest.raises(OffloadError, match="whole number"):
        parse_size("1.0000000000000000001KiB")


@pytest.mark.parametrize("text", ["", "abc", "12XB", "1e3", "-5", "5 Mi B", "inf", "nan",
                                  ".5K", "1,024", "64KiBs", "0x10"])
def test_bad_strings_name_the_value_and_the_fix(text: str) -> None:
    with pytest.raises(OffloadError) as info:
        parse_size(text, what="--cpu-bytes")
    message = str(info.value)
    assert "--cpu-bytes" in message and repr(text) in message and "64KiB" in message
    assert "\n" not in message


def test_fractional_bytes_and_negative_ints_are_rejected() -> None:
    with pytest.raises(OffloadError, match="whole number"):
        parse_size("1.5")
    with pytest.raises(OffloadError, match="whole number"):
        parse_size("0.3KiB")
    with pytest.raises(OffloadError, match="negative"):
        parse_size(-1)


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (256 << 20, "256.00 MiB"), (3 << 29, "1.50 GiB"), (5 << 40, "5.00 TiB"),
    (2048 << 40, "2048.00 TiB"), (-2048, "-2.00 KiB"),
])
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


@given(st.integers(1, 1 << 50))
def test_format_size_is_within_rounding(n: int) -> None:
    value, unit = format_size(n).split()
    scale = BINARY[unit.lower()]
    assert 1 <= float(value) <= 1024 or (unit == "B" and n < 1024)  # 1023.999 KiB prints 1024.00
    assert abs(float(value) * scale - n) <= 0.005 * scale * (1 + 1e-9)  # a half rounds either way


@given(st.integers(0, 1 << 50), st.integers(1, 1 << 20))
def test_round_up(n: int, multiple: int) -> None:
    r = round_up(n, multiple)
    assert r % multiple == 0 and n <= r < n + multiple
