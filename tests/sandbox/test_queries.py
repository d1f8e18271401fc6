"""What a test asks of plain data is never asked of the candidate's own object (`QUERIES` of
`rlkit.sandbox.runners`): every method of the plain types that takes an argument is held here to
one side, a check of plain data against the argument (the expected value, in a test: not asked of a
candidate's object) or an operation that reshapes it by its argument (asked: it sees only its
arguments, as the candidate's functions do). A method a new Python adds fails here until judged."""

from __future__ import annotations

import collections
import decimal
import fractions
import inspect

from rlkit.sandbox.runners import QUERIES

# the types the wire rebuilds as plain data (`rlkit.sandbox.wire`)
PLAIN = (str, bytes, bytearray, int, float, complex, list, tuple, set, frozenset, dict, collections.deque,
         collections.Counter, collections.OrderedDict, collections.defaultdict, fractions.Fraction, decimal.Decimal)

# reshaping by an argument (a width, a separator, a key, an item, a context, a number of places), or
# changing the object in place, or a number out of two (Decimal's max, min and their kin)
RESHAPES = {
    "add", "append", "appendleft", "capitalize", "center", "clear", "conjugate", "copy", "copy_sign", "decode",
    "difference_update", "discard", "encode", "exp", "expandtabs", "extend", "extendleft", "fma", "format",
    "format_map", "from_bytes", "from_decimal", "from_float", "fromhex", "fromkeys", "get", "hex", "insert",
    "intersection_update", "is_normal", "is_subnormal", "isalnum", "isalpha", "isascii", "isdigit", "islower",
    "isspace", "istitle", "isupper", "items", "join", "keys", "limit_denominator", "ljust", "ln", "log10", "logb",
    "logical_and", "logical_invert", "logical_or", "logical_xor", "lower", "lstrip", "maketrans", "max", "max_mag",
    "min", "min_mag", "most_common", "move_to_end", "next_minus", "next_plus", "next_toward", "normalize",
    "number_class", "partition", "pop", "popitem", "popleft", "quantize", "remainder_near", "remove", "replace",
    "reverse", "rjust", "rotate", "rpartition", "rsplit", "rstrip", "scaleb", "setdefault", "shift", "sort",
    "split", "splitlines", "sqrt", "strip", "subtract", "swapcase", "symmetric_difference_update", "title",
    "to_bytes", "to_eng_string", "to_integral", "to_integral_exact", "to_integral_value", "translate", "union",
    "update", "upper", "values", "zfill"}


def _takes_arguments(method) -> bool:
    try:
        return any(p.name not in ("self", "cls") for p in inspect.signature(method).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: counted as taking some
        return True


def test_every_method_of_plain_data_that_takes_an_argument_is_judged():
    methods = {name for kind in PLAIN for name in dir(kind)
               if not name.startswith("_") and callable(getattr(kind, name)) and _takes_arguments(getattr(kind, name))}
    assert methods - QUERIES - RESHAPES == set()  # not judged yet
    assert not QUERIES & RESHAPES
    assert {"startswith", "count", "issubset", "symmetric_difference", "compare"} <= QUERIES
