"""Attacks on ``hash_block_chain``'s one-call-per-block rewrite (commit 27a0e3e): on every
meaningful input the block-by-block version accepted it must give the same hashes, and
where that version raised it must raise the same exception type. Nonsense the old version
answered with hashes (a block size below 1, a negative start, bytes read as raw memory)
is now refused, naming what is wrong.

``_reference_chain`` is the pre-27a0e3e body verbatim (over the module's unchanged
``hash_block``), so the comparison does not depend on git being around."""
from __future__ import annotations

import itertools
from array import array

import numpy as np
import pytest

from services.shared.block_hash import extra_keys_for, hash_block, hash_block_chain

KEYS = extra_keys_for("m", "t")


def _reference_chain(token_ids, block_size, extra_keys=b"", parent=None, start=0):
    if start % block_size:
        raise ValueError(f"start ({start}) must be a multiple of block_size ({block_size})")
    hashes = []
    for begin in range(start, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[begin : begin + block_size], extra_keys)
        hashes.append(parent)
    return hashes


def _outcome(fn, make, *args, **kwargs):
    try:
        return "ok", fn(make(), *args, **kwargs)
    except Exception as exc:  # noqa: BLE001  (the type is the outcome)
        return "raises", type(exc)


def _assert_same(make, *args, **kwargs):
    old = _outcome(_reference_chain, make, *args, **kwargs)
    new = _outcome(hash_block_chain, make, *args, **kwargs)
    assert new == old, f"args={args} kwargs={kwargs}: old {old}, new {new}"
    return new


IDS = [(i * 7919) % 50_000 for i in range(37)]
CONTAINERS = {
    "list": lambda ids: list(ids),
    "tuple": lambda ids: tuple(ids),
    "array_q": lambda ids: array("q", ids),
    "array_i": lambda ids: array("i", ids),
    "array_Q": lambda ids: array("Q", ids),
    "numpy_int64": lambda ids: np.array(ids, dtype=np.int64),
    "numpy_int32": lambda ids: np.array(ids, dtype=np.int32),
    "numpy_uint64": lambda ids: np.array(ids, dtype=np.uint64),
    "numpy_strided": lambda ids: np.repeat(np.array(ids, dtype=np.int64), 2)[::2],
    "numpy_scalars_in_a_list": lambda ids: [np.int64(t) for t in ids],
    "bools": lambda ids: [bool(t % 2) for t in ids],
    "memoryview_q": lambda ids: memoryview(array("q", ids)),
    "range": lambda ids: range(1000, 1000 + len(ids)),
    # wrong element types: both versions must refuse them alike
    "floats": lambda ids: [float(t) for t in ids],
    "numpy_float": lambda ids: np.array(ids, dtype=np.float64),
    "str": lambda ids: "".join(chr(65 + t % 26) for t in ids),
    "none_inside": lambda ids: [*ids[:-1], None],
}


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_every_container_hashes_as_before(container):
    make_ids = CONTAINERS[container]
    for n, block_size, parent in itertools.product((0, 1, 3, 4, 5, 8, 16, 17, 37), (1, 2, 4, 8),
                                                   (None, 0, 12345, 2**64 - 1)):
        for start in sorted({0, block_size, 2 * block_size, 4 * block_size, 40, 64}):
            _assert_same(lambda: make_ids(IDS[:n]), block_size, KEYS, parent=parent, start=start)


def test_list_tuple_array_numpy_and_range_give_the_same_hashes_as_a_list():
    ids = list(range(1000, 1037))
    expected = hash_block_chain(ids, 4, KEYS)
    assert len(expected) == 9
    for make in (tuple, lambda x: array("q", x), np.array, lambda x: np.array(x, dtype=np.int32),
                 lambda x: range(1000, 1037)):
        assert hash_block_chain(make(ids), 4, KEYS) == expected


def test_a_generator_is_refused_as_before():
    assert _assert_same(lambda: (t for t in IDS), 4, KEYS)[0] == "raises"


@pytest.mark.parametrize("ids", [
    [-1, -2, -(2**63), 2**63 - 1],  # the int64 range, both ends
    [2**63, 1, 2, 3],  # past int64: refused
    [-(2**63) - 1, 1, 2, 3],
    [1, 2, 3, 2**64],
])
def test_ids_at_and_past_the_int64_range_behave_as_before(ids):
    for block_size in (1, 2, 4):
        _assert_same(lambda: list(ids), block_size, KEYS)
        _assert_same(lambda: list(ids), block_size, KEYS, parent=7, start=block_size)


def test_a_huge_id_in_a_trailing_partial_block_is_ignored_as_before():
    ids = [1, 2, 3, 4, 2**70]  # the old code never packed the partial block
    assert _assert_same(lambda: ids, 4, KEYS)[0] == "ok"
    assert hash_block_chain(ids, 4, KEYS) == hash_block_chain(ids[:4], 4, KEYS)


@pytest.mark.parametrize("block_size,error", [(0, ValueError), (-1, ValueError), (-4, ValueError),
                                               (2.0, TypeError), (None, TypeError), ("4", TypeError)])
def test_nonsense_block_sizes_are_refused(block_size, error):
    for n, start, parent in itertools.product((0, 2, 3, 8, 10), (0, 4, 8, 100), (None, 9)):
        with pytest.raises(error, match="block_size|integer|index"):
            hash_block_chain(IDS[:n], block_size, KEYS, parent=parent, start=start)


@pytest.mark.parametrize("start", [3, 6, 36, 40, 10**9])
def test_starts_behave_as_before(start):
    for n, block_size, parent in itertools.product((0, 3, 10, 37), (1, 2, 4), (None, 9, -1)):
        _assert_same(lambda: IDS[:n], block_size, KEYS, parent=parent, start=start)


@pytest.mark.parametrize("start,error", [(-12, ValueError), (-4, ValueError), (-3, ValueError), (1, ValueError),
                                          (2.0, TypeError), (None, TypeError)])
def test_negative_odd_and_non_integer_starts_are_refused(start, error):
    for n, block_size in itertools.product((0, 3, 10, 37), (2, 4)):
        with pytest.raises(error):
            hash_block_chain(IDS[:n], block_size, KEYS, start=start)


@pytest.mark.parametrize("parent", [-1, 2**64, 2.5, "p", b"12345678"])
def test_bad_parents_are_refused_with_the_old_exception_type_even_with_bad_ids(parent):
    for make in (lambda: IDS[:8], lambda: [0.5] * 8, lambda: "abcdefgh", lambda: [2**64] * 8, lambda: []):
        _assert_same(make, 4, KEYS, parent=parent)


@pytest.mark.parametrize("extra", [b"", b"\x00" * 300, bytearray(b"k"), memoryview(b"kv"), "str-keys", None, 5])
def test_extra_key_types_behave_as_before(extra):
    for n in (0, 3, 8):
        _assert_same(lambda: IDS[:n], 4, extra)


@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_bytes_as_token_ids_are_refused(kind):
    """A bytes-like is a Sequence[int], but ``array('q', ...)`` reads it as raw memory (the
    old code did, block by block): never a list of token ids."""
    for n in (0, 8, 64):
        with pytest.raises(TypeError, match="token_ids"):
            hash_block_chain(kind(range(n)), 4, KEYS)
