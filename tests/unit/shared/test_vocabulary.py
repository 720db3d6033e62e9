"""The shared vocabulary is the wire vocabulary: every proto enum value has its word here
and back, and the one priority convention sorts higher first."""
from __future__ import annotations

import pytest

from services.shared.vocabulary import (
    POOL_RUNG_LABELS, REQUEST_CLASS_LABELS, RUNG_LABELS, RequestClass, Rung, partition_of, queue_order_key,
)
from weft.v1 import common_pb2


def test_every_degradation_rung_of_the_proto_has_one_word_and_the_same_order():
    names = [n for n in common_pb2.DegradationRung.keys() if n != "DEGRADATION_RUNG_UNSPECIFIED"]
    assert [n.removeprefix("DEGRADATION_RUNG_").lower() for n in names] == list(RUNG_LABELS)
    assert [Rung.parse(label) for label in RUNG_LABELS] == sorted(Rung)


def test_every_request_class_of_the_proto_has_one_word():
    names = [n for n in common_pb2.RequestClass.keys() if n != "REQUEST_CLASS_UNSPECIFIED"]
    assert sorted(n.removeprefix("REQUEST_CLASS_").lower() for n in names) == sorted(REQUEST_CLASS_LABELS)


def test_unknown_words_are_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="kv_int8"):
        Rung.parse("turbo")
    with pytest.raises(ValueError, match="interactive"):
        RequestClass.parse("vip")
    assert RequestClass.parse(" Batch ") is RequestClass.BATCH


def test_a_pool_cannot_serve_the_shed_rung():
    assert "shed" not in POOL_RUNG_LABELS and set(POOL_RUNG_LABELS) < set(RUNG_LABELS)


def test_higher_priority_sorts_first_in_an_ascending_queue():
    queue = sorted([("low", -1.0), ("high", 5.0), ("mid", 0.0)], key=lambda r: queue_order_key(r[1]))
    assert [name for name, _ in queue] == ["high", "mid", "low"]


@pytest.mark.parametrize(("partition", "salt", "expected"), [
    ("gold", "acme", "gold"), ("", "acme", "acme"), ("", "", "default"),
])
def test_a_request_is_charged_to_its_partition_else_its_tenant_else_the_default(partition, salt, expected):
    assert partition_of(partition, salt) == expected
