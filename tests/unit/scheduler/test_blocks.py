from services.scheduler.state.blocks import num_blocks_spanned, num_full_blocks


def test_tokens_span_rounded_up_blocks_and_fill_rounded_down_ones():
    assert [num_blocks_spanned(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    assert [num_full_blocks(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 0, 1, 1, 2]
    assert num_blocks_spanned(5, 0) == 5 and num_full_blocks(5, 0) == 5  # unknown block size: 1
