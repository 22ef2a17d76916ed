"""The restricted format values cross the sandbox in: round trips, and everything else refused."""

from __future__ import annotations

import itertools
import math
import time

import pytest

from sparrow_nemo.rewards import code_checker
from sparrow_nemo.rewards import sandbox_wire as wire
from sparrow_nemo.rewards.code_sandbox import SandboxLimits


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


def test_sets_and_dicts_of_colliding_hashes_are_refused_in_linear_time() -> None:
    """80,000 ints of one hash value (k * (2**61 - 1) + 1) would cost 3.2e9 comparisons in a set; refused
    after nine of them. A few honest collisions (hash(-1) == hash(-2)) still decode."""
    colliding = [k * (2**61 - 1) + 1 for k in range(80_000)]
    for obj in ({"s": colliding}, {"fs": colliding}, {"d": [[k, 0] for k in colliding]}):
        with pytest.raises(wire.WireError, match="share one hash value"):
            wire.decode(obj)
    assert wire.decode({"s": [-1, -2, 1, 2]}) == {-1, -2, 1, 2}
    assert len(wire.decode({"s": colliding[: wire.MAX_SAME_HASH]})) == wire.MAX_SAME_HASH


REQUEST = {"call": {"h": 1}, "args": [[3, 1]], "kwargs": {"d": []}}


@pytest.mark.parametrize(
    ("request_", "reply", "why"),
    [
        ({"resolve": ["f"]}, {"id": 7}, "no 'values'"),
        ({"resolve": ["f"]}, {"id": 7, "values": [1]}, "'values' must be a dict"),
        ({"resolve": ["f"]}, {"id": 7, "values": {"f": 1, "check": {"h": 2}}}, "not asked for"),
        ({"resolve": ["f"]}, {"id": 7, "values": {"f": {"zz": 1}}}, "not a wire value"),
        (REQUEST, {"id": 7}, "no 'value'"),
        (REQUEST, {"id": 7, "value": 1, "mutated": []}, "'mutated' must be a dict"),
        (REQUEST, {"id": 7, "value": 1, "mutated": {"-1": 1}}, "names no argument"),
        (REQUEST, {"id": 7, "value": 1, "mutated": {"1": 1}}, "names no argument"),
        (REQUEST, {"id": 7, "value": 1, "mutated": {"0x0": 1}}, "names no argument"),
        (REQUEST, {"id": 7, "value": 1, "mutated": {"9" * 5000: 1}}, "ValueError"),
        (REQUEST, {"id": 7, "value": {"s": [[1]]}}, "unhashable"),
        (REQUEST, {"id": 8, "value": 1}, "another request"),
        (REQUEST, {"id": 7, "raised": 5}, "expected a string"),
    ],
)
def test_every_malformed_reply_loses_the_program_and_is_logged(
    request_: dict, reply: dict, why: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the relay does with a reply it cannot use: the program's sandbox is stopped, the checker hears
    ``lost`` (the case fails) and the reason is logged; nothing is raised out of the reward."""

    class Box:
        failure = None

        def send(self, message: dict) -> None:
            assert message["id"] == 7

        def receive(self, deadline: float, cap: int) -> dict:
            return reply

        def stop(self, reason: str) -> None:
            self.failure = reason

    monkeypatch.setattr(code_checker, "_request_ids", itertools.count(7))
    answer = code_checker._forward(Box(), request_, time.monotonic() + 60, SandboxLimits())
    assert set(answer) == {"lost"} and why in answer["lost"], answer
    assert why in caplog.text


def test_well_formed_replies_are_relayed(monkeypatch: pytest.MonkeyPatch) -> None:
    class Box:
        failure = None

        def send(self, message: dict) -> None:
            pass

        def receive(self, deadline: float, cap: int) -> dict:
            return {"id": 3, "value": {"s": [1, 2]}, "mutated": {"0": [1, 3]}}

    monkeypatch.setattr(code_checker, "_request_ids", itertools.count(3))
    answer = code_checker._forward(Box(), REQUEST, time.monotonic() + 60, SandboxLimits())
    assert answer == {"value": {"s": [1, 2]}, "mutated": {"0": [1, 3]}}
