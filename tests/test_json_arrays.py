"""shardrec-serve's JSON reader (native/src/serving/json_numbers.h, module shardrec.native.json_arrays)
against Python's own json module as the oracle: on random documents and on random damage to them,
the same value (each rectangular array of numbers a numpy array: what numpy makes of Python's list
there) or, for a body json.loads refuses, a ValueError naming where."""
import json
import math

import numpy as np
import pytest

from shardrec.native import json_arrays


def _same(ours, want) -> bool:
    """`ours` (json_arrays' value) is `want` (json.loads'), each numpy array of ours being what numpy
    makes of Python's list there: its dtype, shape and values (NaN equal to NaN)."""
    if isinstance(ours, np.ndarray):
        w = np.asarray(want)
        return ours.dtype == w.dtype and ours.shape == w.shape and np.array_equal(
            ours, w, equal_nan=ours.dtype.kind == "f")
    if isinstance(ours, float) and isinstance(want, float) and math.isnan(ours) and math.isnan(want):
        return True
    if isinstance(ours, list) and isinstance(want, list):
        return len(ours) == len(want) and all(_same(x, y) for x, y in zip(ours, want))
    if isinstance(ours, dict) and isinstance(want, dict):
        return ours.keys() == want.keys() and all(_same(ours[k], want[k]) for k in ours)
    return type(ours) is type(want) and ours == want


def _random_value(rng, depth=0):
    kind = rng.integers(0, 9 if depth < 4 else 5)
    if kind == 0:
        return int(rng.integers(-2**63, 2**63 - 1)) if rng.random() < 0.5 else int(rng.integers(-9, 9)) * 10**int(rng.integers(0, 25))
    if kind == 1:
        return float(rng.normal() * 10.0 ** rng.integers(-30, 30))
    if kind == 2:
        return "".join(rng.choice(list("ab\"\\/é😀\n\t\u2028x")) for _ in range(rng.integers(0, 6)))
    if kind == 3:
        return [True, False, None][rng.integers(0, 3)]
    if kind == 4:
        return []
    if kind in (5, 6):  # a rectangular array of one kind of number
        shape = tuple(int(n) for n in rng.integers(1, 4, rng.integers(1, 4)))
        if kind == 5:
            return rng.integers(-2**40, 2**40, shape).tolist()
        return rng.normal(size=shape).tolist()
    if kind == 7:
        return [_random_value(rng, depth + 1) for _ in range(rng.integers(0, 4))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.integers(0, 4))}


def test_random_documents_read_as_python_reads_them():
    rng = np.random.default_rng(3)
    for _ in range(600):
        doc = {"inputs": _random_value(rng)}
        body = json.dumps(doc, ensure_ascii=bool(rng.integers(0, 2))).encode()
        got = json_arrays.parse(body)
        assert _same(got, json.loads(body)), body


def test_rectangular_arrays_are_numpy_of_the_right_dtype_and_others_stay_lists():
    parse = json_arrays.parse
    ids = np.arange(256 * 26, dtype=np.int64).reshape(256, 26) * 7919
    got = parse(json.dumps({"inputs": {"ids": ids.tolist()}}).encode())["inputs"]["ids"]
    assert got.dtype == np.int64 and got.shape == (256, 26) and (got == ids).all()
    assert parse(b"[1, 2.5]").dtype == np.float64 and parse(b"[true, false]").dtype == np.bool_
    assert parse(b"[[1e999, -1e999, NaN]]").tolist()[0][:2] == [math.inf, -math.inf]
    for kept in (b"[[1, 2], [3]]", b"[1, [2]]", b"[true, 1]", b'[1, "a"]', b"[]", b"[[]]",
                 b"[18446744073709551616]", b"[null]"):
        assert isinstance(parse(kept), list), kept
        assert _same(parse(kept), json.loads(kept)), kept
    deep = b"[" * 40 + b"1" + b"]" * 40  # deeper than numpy's 32 dimensions: lists, as Python's
    assert _same(parse(deep), json.loads(deep))


@pytest.mark.parametrize("body", [b"{not json", b"[1,]", b"[1] x", b'"\xff"', b"[01]", b"", b"[1 2]",
                                  b'{"a" 1}', b'{"a": 1,}', b"[-]", b"[1.]", b"[.5]", b"[+1]", b'"\\x"', b'"a',
                                  b'"\x01"', b"tru", b"[1e]"])
def test_what_json_loads_refuses_is_refused_with_the_place(body):
    with pytest.raises(ValueError):
        json.loads(body)
    with pytest.raises(ValueError, match=r"at byte \d+"):
        json_arrays.parse(body)


def test_damaged_documents_are_refused_when_and_only_when_python_refuses_them():
    rng = np.random.default_rng(5)
    checked = 0
    for _ in range(1500):
        body = bytearray(json.dumps({"inputs": _random_value(rng), "signature_name": "s"}).encode())
        for _ in range(rng.integers(1, 3)):
            at = int(rng.integers(0, len(body)))
            body[at] = int(rng.choice(list(b'[]{},:"0123456789.-eE \\tfnu'))) if rng.random() < 0.8 else int(rng.integers(0, 256))
        body = bytes(body)
        try:
            want = json.loads(body)
        except (ValueError, RecursionError):
            with pytest.raises(ValueError):
                json_arrays.parse(body)
            continue
        assert _same(json_arrays.parse(body), want), body
        checked += 1
    assert checked > 100


def test_too_deep_a_body_is_refused_by_name():
    with pytest.raises(ValueError, match="nested too deeply"):
        json_arrays.parse(b"[" * 5000 + b"]" * 5000)
