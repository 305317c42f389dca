"""A request's image tokens in the TUI: the snapshot's `image_spans` read (bad ones named), the blocks that hold
them found (against the token-by-token count), drawn as a cyan ▣ among the selected request's blocks with a
legend entry, and the request marked in the slots table."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from localserve.tui.block_map import IMAGE_COLOUR, IMAGE_GLYPH, SELECTED_COLOUR, BlockMap, build_cells
from localserve.tui.feed import FeedError, parse_hello, parse_snapshot
from localserve.tui.image_spans import image_block_ids, image_block_indices
from localserve.tui.slots import SlotsTable, row_cells

from tests.helpers.monitor_frames import hello_frame, request_entry, snapshot_frame
from tests.helpers.tui_pilot import map_cells, run_with_monitor, wait_until


def parsed(**fields):
    frame = snapshot_frame("u" * 4 + "." * 60, requests=[request_entry("r1", "decode", [[0, 1, 2, 3]], **fields)])
    return parse_snapshot(frame, parse_hello(hello_frame(64))).requests[0]


def test_spans_are_read_and_an_older_server_sends_none():
    assert parsed(image_spans=[[3, 20], [30, 5]], num_prompt_tokens=40).image_spans == ((3, 20), (30, 5))
    assert parsed().image_spans == ()
    assert row_cells(parsed(image_spans=[[3, 20]]))[1] == "decode [1 image]"
    assert row_cells(parsed(image_spans=[[0, 4], [4, 4]], constrained=True))[1] == "decode [grammar, 2 images]"


@pytest.mark.parametrize("spans, message", [
    ({"a": 1}, r"requests\[0\].image_spans must be a list, got dict"),
    ([[1, 2, 3]], r"image_spans\[0\] must be \[offset, length\]"),
    ([[True, 2]], r"image_spans\[0\] must be \[offset, length\]"),
    ([[0, 1.5]], r"image_spans\[0\] must be \[offset, length\]"),
    ([[0, 0]], r"image_spans\[0\] = \[0, 0\] must lie in the prompt of 40 tokens"),
    ([[-1, 2]], r"image_spans\[0\] = \[-1, 2\] must lie"),
    ([[30, 11]], r"image_spans\[0\] = \[30, 11\] must lie in the prompt of 40"),
    ([[0, 10], [9, 2]], r"image_spans\[1\] = \[9, 2\] must lie .* after the span before it \(from 10\)"),
])
def test_bad_spans_name_the_entry(spans, message):
    with pytest.raises(FeedError, match=message):
        parsed(image_spans=spans)


@pytest.mark.parametrize("span, block_size, expected", [
    ((0, 1), 16, {0}), ((0, 16), 16, {0}), ((0, 17), 16, {0, 1}), ((15, 1), 16, {0}), ((15, 2), 16, {0, 1}),
    ((16, 16), 16, {1}), ((16, 17), 16, {1, 2}), ((5, 256), 16, set(range(17))), ((7, 3), 1, {7, 8, 9}),
])
def test_the_blocks_of_a_span_at_each_bound(span, block_size, expected):
    assert image_block_indices([span], block_size) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), max_size=4), st.integers(1, 32),
       st.lists(st.integers(0, 63), min_size=0, max_size=12, unique=True))
def test_the_blocks_holding_image_tokens_are_those_of_its_tokens(gaps_and_lengths, block_size, table):
    spans, end = [], 0
    for gap, length in gaps_and_lengths:
        spans.append((end + gap, length))
        end += gap + length
    tokens = {token for offset, length in spans for token in range(offset, offset + length)}
    assert image_block_indices(spans, block_size) == {token // block_size for token in tokens}
    expected = {table[token // block_size] for token in tokens if token // block_size < len(table)}
    assert image_block_ids([table, table[:2]], spans, block_size) == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 200), st.integers(1, 120), st.data())
def test_a_cell_is_an_image_cell_when_a_selected_block_in_it_holds_image_tokens(num_blocks, max_cells, data):
    codes = np.array(data.draw(st.lists(st.integers(0, 3), min_size=num_blocks, max_size=num_blocks)), np.uint8)
    selected = np.array(data.draw(st.lists(st.booleans(), min_size=num_blocks, max_size=num_blocks)), bool)
    image = np.array(data.draw(st.lists(st.booleans(), min_size=num_blocks, max_size=num_blocks)), bool)
    grid = build_cells(codes, selected, max_cells, image)
    if not (image & selected).any():
        assert grid.image is None
        return
    per_cell = grid.blocks_per_cell
    for cell in range(grid.states.size):
        blocks = slice(cell * per_cell, (cell + 1) * per_cell)
        assert grid.image[cell] == (image[blocks] & selected[blocks]).any()


# r1's prompt: 40 text tokens, an image of 64 tokens (40..103), 6 more: blocks 2-6 of its table hold image tokens.
STATES = "u" * 8 + "." * 56
R1 = request_entry("r1", "decode", [[7, 6, 5, 4, 3, 2, 1]], num_prompt_tokens=110, num_computed_prompt_tokens=110,
                   image_spans=[[40, 64]])
R2 = request_entry("r2", "decode", [[0]])


def test_the_selected_requests_image_blocks_are_drawn_with_their_glyph_and_a_legend_entry():
    async def scenario(pilot, app, monitor):
        monitor.send(snapshot_frame(STATES, requests=[R1, R2]))
        await wait_until(pilot, lambda: len(app.query_one(SlotsTable).rows) == 2, "two rows")
        assert app.query_one(SlotsTable).rows[0][1] == "decode [1 image]"
        block_map = app.query_one(BlockMap)
        assert IMAGE_GLYPH not in "".join(glyph for glyph, _ in map_cells(block_map))  # nothing selected yet
        app.query_one(SlotsTable).focus()
        await pilot.press("enter")  # the cursor starts on r1
        await pilot.pause()
        cells = map_cells(block_map)
        image_blocks = {5, 4, 3, 2, 1}  # table indices 2-6
        for block, (glyph, colour) in enumerate(cells[:8]):
            if block in image_blocks:
                assert (glyph, colour) == (IMAGE_GLYPH, IMAGE_COLOUR), block
            else:
                assert glyph != IMAGE_GLYPH and colour == ("#5faf5f" if block == 0 else SELECTED_COLOUR), block
        legend = "".join(block_map.render_line(y).text for y in range(block_map.size.height))
        assert f"{IMAGE_GLYPH} image tokens 5" in legend
        assert "r1: 7 blocks, 0 shared, 5 with image tokens" in block_map.border_subtitle
        await pilot.press("down", "enter")  # r2: no image
        await pilot.pause()
        assert IMAGE_GLYPH not in "".join(glyph for glyph, _ in map_cells(block_map))
        legend = "".join(block_map.render_line(y).text for y in range(block_map.size.height))
        assert "image tokens" not in legend
    run_with_monitor(scenario)
