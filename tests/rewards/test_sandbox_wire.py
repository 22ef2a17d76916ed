"""The restricted format values cross the sandbox in: round trips, and everything else refused."""

from __future__ import annotations

import math

import pytest

from sparrow_nemo.rewards import sandbox_wire as wire


def _roundtrip(value: object) -> object:
    return wire.decode(wire.loads(wire.dumps({"v": wire.encode(value)}))["v"])


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -(10**40),
        1.5,
        "tëxt\n",
        [1, [2]],
        (1, (2, 3)),
        {1, 2},
        frozenset({3}),
        {"a": 1, (1, 2): [3]},
        b"\x00\xff",
        1 + 2j,
        [],
        (),
    ],
)
def test_plain_values_round_trip_with_their_types(value: object) -> None:
    back = _roundtrip(value)
    assert back == value and type(back) is type(value)


def test_non_finite_floats_are_tagged_and_strict_json() -> None:
    line = wire.dumps({"v": wire.encode([math.inf, -math.inf, math.nan])})
    assert b"Infinity" not in line and b"NaN" not in line
    inf, ninf, nan = wire.decode(wire.loads(line)["v"])
    assert inf == math.inf and ninf == -math.inf and math.isnan(nan)


def test_objects_with_code_do_not_cross() -> None:
    class Liar(int):
        def __eq__(self, other: object) -> bool:
            return True

    for value in (Liar(3), object(), print, [1, Liar(2)], {"k": object()}):
        with pytest.raises(wire.WireError, match="cannot cross"):
            wire.encode(value)
    kept: list[object] = []
    encoded = wire.encode([print], lambda obj: kept.append(obj) or len(kept))
    assert encoded == [{"h": 1}] and kept == [print]
    assert isinstance(wire.decode(encoded)[0], wire.Handle)


@pytest.mark.parametrize(
    "line",
    [b"[" * 100_000, b'{"v": NaN}', b"[1]", b"\xff\xfe", b'{"v": 1', b"5"],
)
def test_malformed_messages_are_refused(line: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.loads(line)


@pytest.mark.parametrize(
    "obj",
    [
        {"x": 1},
        {"s": [[1]]},
        {"d": [[[1], 2]]},
        {"d": [[1]]},
        {"t": 5},
        {"b": "zz"},
        {"h": "1"},
        {"f": "1e999"},
        {"t": [1], "s": [2]},
    ],
)
def test_values_outside_the_format_are_refused(obj: object) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(obj)


def test_depth_and_long_ints_are_refused_on_both_sides() -> None:
    deep: list = []
    for _ in range(wire.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(wire.WireError, match="deeper"):
        wire.encode(deep)
    raw: object = []
    for _ in range(wire.MAX_DEPTH + 5):
        raw = [raw]
    with pytest.raises(wire.WireError, match="deeper"):
        wire.decode(raw)
    with pytest.raises(wire.WireError):
        wire.encode(10**5000)
