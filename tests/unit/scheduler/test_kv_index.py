from services.shared.block_hash import extra_keys_for, hash_block_chain
from services.scheduler.state.kv_index import KvIndex


def test_match_counts_only_leading_blocks_per_executor():
    idx = KvIndex()
    idx.stored("a", [1, 2, 3])
    idx.stored("b", [1, 2])
    idx.stored("c", [2, 3])  # no first block: no prefix match
    assert idx.match_prefix([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert idx.match_prefix([9, 1, 2]) == {}


def test_removed_blocks_stop_matching_and_later_blocks_do_not_count():
    idx = KvIndex()
    idx.stored("a", [1, 2, 3])
    idx.removed("a", [2])
    assert idx.match_prefix([1, 2, 3]) == {"a": 1}
    assert idx.num_blocks("a") == 2
    assert idx.holders(2) == frozenset()


def test_drop_source_forgets_everything_of_that_executor_only():
    idx = KvIndex()
    idx.stored("a", [1, 2])
    idx.stored("b", [1])
    assert idx.drop_source("a") == 2
    assert idx.match_prefix([1, 2]) == {"b": 1}
    assert idx.num_blocks("a") == 0
    idx.removed("a", [1])  # unknown source: harmless
    assert idx.holders(1) == frozenset({"b"})


def test_match_can_be_restricted_to_given_sources():
    idx = KvIndex()
    idx.stored("a", [1, 2])
    idx.stored("b", [1, 2])
    assert idx.match_prefix([1, 2], sources=["b"]) == {"b": 2}


def test_tenant_salt_separates_identical_prompts():
    tokens = list(range(64))
    a = hash_block_chain(tokens, 16, extra_keys_for("m", "tenant-a"))
    b = hash_block_chain(tokens, 16, extra_keys_for("m", "tenant-b"))
    idx = KvIndex()
    idx.stored("x", a)
    assert idx.match_prefix(a) == {"x": 4}
    assert idx.match_prefix(b) == {}
