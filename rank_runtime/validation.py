"""Parameter checks that fail at graph-build time with the parameter, its value and what is allowed."""
import numbers
from typing import Any, Sequence, Tuple, Union

INT32_MAX = 2**31 - 1


def _where(owner, name):
    return f"{owner}: parameter '{name}'" if owner else f"parameter '{name}'"


def check_type(owner: str, name: str, value: Any, types: Union[type, Tuple[type, ...]], allowed_text: str) -> Any:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise TypeError(f"{_where(owner, name)} must be {allowed_text}, got bool {value!r}")
    if not isinstance(value, types):
        raise TypeError(f"{_where(owner, name)} must be {allowed_text}, got {type(value).__name__} {value!r}")
    return value


def check_int(owner: str, name: str, value: Any, lo: int, hi: int) -> int:
    """An int (not bool) in [lo, hi]."""
    check_type(owner, name, value, numbers.Integral, f"an int in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise ValueError(f"{_where(owner, name)} = {value} is out of range; allowed: [{lo}, {hi}]")
    return int(value)


def check_number(owner: str, name: str, value, lo: float, hi: float, lo_open: bool = False,
                 hi_open: bool = False) -> float:
    """A real number within bounds; None for a bound means unbounded."""
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    allowed = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"
    check_type(owner, name, value, numbers.Real, f"a number in {allowed}")
    v = float(value)
    ok_lo = lo is None or (v > lo if lo_open else v >= lo)
    ok_hi = hi is None or (v < hi if hi_open else v <= hi)
    if not (ok_lo and ok_hi) or v != v:
        raise ValueError(f"{_where(owner, name)} = {value} is out of range; allowed: {allowed}")
    return v


def check_bool(owner: str, name: str, value: Any) -> bool:
    return check_type(owner, name, value, bool, "a bool")


def check_choice(owner: str, name: str, value: Any, choices: Sequence[Any]) -> Any:
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{_where(owner, name)} = {value!r} is not allowed; allowed: {allowed}")
    return value


def check_dtype(owner: str, name: str, value: Any, allowed: tuple) -> Any:
    """One of the TensorFlow dtypes `allowed` (a dtype or anything tf.as_dtype takes)."""
    import tensorflow as tf

    try:
        dtype = tf.as_dtype(value)
    except TypeError:
        dtype = None
    if dtype not in allowed:
        names = ", ".join(f"tf.{d.name}" for d in allowed)
        raise TypeError(f"{_where(owner, name)} must be one of {names}, got {value!r}")
    return dtype
