"""The block map: every KV block of the pool a cell, coloured by its state.

A cell is one character. When the pool has more blocks than the widget has cells, each cell stands
for `blocks_per_cell` consecutive blocks and shows the state most of them are in (ties go to the
busier state, so a cell of one used and one free block reads as used), and the legend says so. The
glyph tells the state apart even without colour (a `tmux capture-pane` of the screen keeps it):
`·` free, `░` free with cached contents, `█` used, `▓` shared, `▒` swapped out (swap pool). The blocks
of the selected request are drawn in yellow: `█` its own, `▓` those it shares; those of its blocks that
hold image tokens (the snapshot's `image_spans`) are a cyan `▣`.

The cells are computed with numpy once per frame and size, and kept as strips until either changes,
so a pool of 65,536 blocks costs a few milliseconds per frame, not per repaint.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from localserve.tui.feed import BlockState
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.strip import Strip
from textual.widget import Widget

GLYPHS = {BlockState.EMPTY: "·", BlockState.CACHED: "░", BlockState.USED: "█", BlockState.SHARED: "▓",
          BlockState.SWAPPED: "▒"}
COLOURS = {BlockState.EMPTY: "#585858", BlockState.CACHED: "#5f87d7", BlockState.USED: "#5faf5f",
           BlockState.SHARED: "#d75fd7", BlockState.SWAPPED: "#d7875f"}
SELECTED_COLOUR = "#ffff00"
IMAGE_COLOUR = "#00d7d7"  # the selected request's blocks that hold image tokens
IMAGE_GLYPH = "▣"
LEGEND_NAMES = {BlockState.EMPTY: "free", BlockState.CACHED: "cached", BlockState.USED: "used",
                BlockState.SHARED: "shared", BlockState.SWAPPED: "swapped"}
NO_BLOCK = 255  # a cell past the last block
# Majority vote order: on a tie the first of these wins.
_BUSIEST_FIRST = (BlockState.SHARED, BlockState.USED, BlockState.SWAPPED, BlockState.CACHED, BlockState.EMPTY)


@dataclass(frozen=True, slots=True)
class CellGrid:
    """What each cell of a map shows, row-major, one entry per cell that holds blocks."""

    states: np.ndarray  # uint8: the state most of the cell's blocks are in
    selected: np.ndarray  # bool: the cell holds a block of the selected request
    selected_shared: np.ndarray  # bool: ... and one of those is shared
    blocks_per_cell: int
    image: np.ndarray | None = None  # bool: ... and one of those holds image tokens (None: none does)


def build_cells(block_states: np.ndarray, selected: np.ndarray, max_cells: int,
                image: np.ndarray | None = None) -> CellGrid:
    """The cells that show `block_states` (and the `selected` mask over them, and the `image` mask of the
    selected blocks that hold image tokens) in at most `max_cells`."""
    num_blocks = block_states.size
    blocks_per_cell = max(1, -(-num_blocks // max(1, max_cells)))
    image = image & selected if image is not None else None
    image = image if image is not None and image.any() else None
    if blocks_per_cell == 1:
        return CellGrid(block_states, selected.copy(), selected & (block_states == BlockState.SHARED), 1, image)
    num_cells = -(-num_blocks // blocks_per_cell)
    padding = num_cells * blocks_per_cell - num_blocks

    def by_cell(mask: np.ndarray) -> np.ndarray:
        return np.concatenate([mask, np.zeros(padding, bool)]).reshape(num_cells, -1)

    padded = np.concatenate([block_states, np.full(padding, NO_BLOCK, np.uint8)]).reshape(num_cells, -1)
    padded_selected = by_cell(selected)
    counts = np.stack([(padded == state).sum(axis=1) for state in _BUSIEST_FIRST])
    states = np.array(_BUSIEST_FIRST, dtype=np.uint8)[counts.argmax(axis=0)]
    return CellGrid(states, padded_selected.any(axis=1),
                    (padded_selected & (padded == BlockState.SHARED)).any(axis=1), blocks_per_cell,
                    by_cell(image).any(axis=1) if image is not None else None)


def cell_looks(base: Style) -> dict[int, tuple[str, Style]]:
    """Glyph and style per cell key (see `_cell_keys`), on top of the widget's own style."""
    looks = {}
    image_look = (IMAGE_GLYPH, base + Style(color=IMAGE_COLOUR, bold=True))
    for state, colour in COLOURS.items():
        looks[int(state) * 8] = (GLYPHS[state], base + Style(color=colour))
        # Selected: drawn as its own (█) or shared (▓) block, whatever most of the cell's blocks are.
        looks[int(state) * 8 + 2] = (GLYPHS[BlockState.USED], base + Style(color=SELECTED_COLOUR, bold=True))
        looks[int(state) * 8 + 3] = (GLYPHS[BlockState.SHARED], base + Style(color=SELECTED_COLOUR, bold=True))
        looks[int(state) * 8 + 6] = looks[int(state) * 8 + 7] = image_look  # selected, holding image tokens
    return looks


def _cell_keys(grid: CellGrid) -> np.ndarray:
    """One small integer per cell that fixes its glyph and style: state * 8 + image * 4 + selected * 2 +
    shared."""
    keys = grid.states.astype(np.int32) * 8 + grid.selected * 2 + grid.selected_shared
    return keys + grid.image * 4 if grid.image is not None else keys


def grid_strips(grid: CellGrid, columns: int, max_rows: int, base: Style, cell_width: int = 1) -> list[Strip]:
    """The rows of a grid of `columns` cells as strips; runs of equal cells are merged into one segment.

    A cell is its glyph, followed by `cell_width - 1` spaces that keep neighbouring blocks apart."""
    keys = _cell_keys(grid)[:columns * max_rows]
    looks = {key: (glyph + " " * (cell_width - 1), style) for key, (glyph, style) in cell_looks(base).items()}
    run_starts = np.flatnonzero(np.diff(keys, prepend=-1)).tolist()
    run_keys = keys[run_starts].tolist()
    run_starts.append(keys.size)
    strips, segments, row_end, row_width = [], [], columns, columns * cell_width
    for index, key in enumerate(run_keys):
        start, end = run_starts[index], run_starts[index + 1]
        glyph, style = looks[key]
        while end > row_end:  # the run wraps onto the next row
            segments.append(Segment(glyph * (row_end - start), style))
            strips.append(Strip(segments, row_width))
            segments, start, row_end = [], row_end, row_end + columns
        segments.append(Segment(glyph * (end - start), style))
        if end == row_end:
            strips.append(Strip(segments, row_width))
            segments, row_end = [], row_end + columns
    if segments:
        strips.append(Strip(segments, keys.size % columns * cell_width).extend_cell_length(row_width, base))
    return strips


class BlockMap(Widget):
    """Every block of the GPU pool (and of the swap pool, when there is one), with a legend."""

    DEFAULT_CSS = "BlockMap { height: 1fr; }"

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.block_states = np.zeros(0, np.uint8)
        self.cpu_block_states = np.zeros(0, np.uint8)
        self.selected_label: str | None = None
        self.selected_blocks: frozenset[int] = frozenset()
        self.image_blocks: frozenset[int] = frozenset()  # the selected request's blocks holding image tokens
        self.grid: CellGrid | None = None  # the GPU pool's cells as last drawn (tests read it)
        self.cell_width = 1  # characters per cell
        self._strips: list[Strip] | None = None

    def show(self, block_states: np.ndarray, cpu_block_states: np.ndarray, label: str | None = None,
             block_ids: Iterable[int] = (), image_block_ids: Iterable[int] = ()) -> None:
        """Draw these block states (uint8 `BlockState` codes) from now on, with request `label`'s blocks
        highlighted (None: no request), those of them in `image_block_ids` as holding image tokens."""
        self.block_states, self.cpu_block_states = block_states, cpu_block_states
        self.select(label, block_ids, image_block_ids)

    def select(self, label: str | None, block_ids: Iterable[int] = (), image_block_ids: Iterable[int] = ()) -> None:
        """Highlight the blocks of request `label` (None: no request), and those of them that hold image tokens."""
        self.selected_label, self.selected_blocks = label, frozenset(block_ids)
        self.image_blocks = frozenset(image_block_ids) & self.selected_blocks
        self._invalidate()

    def _invalidate(self) -> None:
        # Built here rather than while rendering: building sets the border's subtitle (the scale),
        # which must not change in the middle of a paint.
        self._strips = self._build_strips()
        self.refresh()

    def on_resize(self) -> None:
        self._invalidate()

    def render_line(self, y: int) -> Strip:
        if self._strips is not None and y < len(self._strips):
            return self._strips[y]
        return Strip.blank(self.size.width, self.rich_style)

    def _mask(self, blocks: frozenset[int]) -> np.ndarray:
        mask = np.zeros(self.block_states.size, bool)
        if blocks:
            ids = np.fromiter(blocks, np.int64)
            mask[ids[(ids >= 0) & (ids < mask.size)]] = True
        return mask

    def _build_strips(self) -> list[Strip]:
        width, height = self.size.width, self.size.height
        base = self.rich_style
        if width < 1 or height < 1:
            return []
        num_cpu = self.cpu_block_states.size
        cpu_rows = min(2 if height >= 12 else 1, -(-num_cpu // width)) if num_cpu else 0
        cpu_grid = build_cells(self.cpu_block_states, np.zeros(num_cpu, bool), cpu_rows * width)
        swap_title = [Strip([Segment("swap pool (CPU)".ljust(width, "─")[:width], base + Style(dim=True))])]
        legend_lines = self._legend().wrap(self.app.console, width, overflow="ellipsis")
        gpu_rows = max(1, height - len(legend_lines) - (cpu_rows + 1 if cpu_rows else 0))
        selected = self._mask(self.selected_blocks)
        # A small pool gets cells two characters wide when that still shows every block: easier to see.
        self.cell_width = 2 if self.block_states.size <= (width // 2) * gpu_rows else 1
        columns = width // self.cell_width
        self.grid = build_cells(self.block_states, selected, gpu_rows * columns, self._mask(self.image_blocks))
        strips = [strip.extend_cell_length(width, base)
                  for strip in grid_strips(self.grid, columns, gpu_rows, base, self.cell_width)]
        if cpu_rows:
            strips += swap_title + grid_strips(cpu_grid, width, cpu_rows, base)
        self._set_subtitle(self.grid, cpu_grid, selected)
        strips += [Strip(line.render(self.app.console), line.cell_len).extend_cell_length(width, base)
                   for line in legend_lines]
        return strips[:height]

    def _set_subtitle(self, grid: CellGrid, cpu_grid: CellGrid, selected: np.ndarray) -> None:
        """The scale of the map, and the selected request's blocks, on the bottom border."""
        parts = []
        if self.selected_label is not None:
            num_shared = int((self.block_states[selected] == BlockState.SHARED).sum())
            images = f", {len(self.image_blocks)} with image tokens" if self.image_blocks else ""
            parts.append(f"[bold {SELECTED_COLOUR}]{self.selected_label}: {int(selected.sum())} blocks, "
                         f"{num_shared} shared{images}[/]")
        parts.append(f"{grid.blocks_per_cell} block{'s' if grid.blocks_per_cell > 1 else ''}/cell")
        if cpu_grid.blocks_per_cell > 1:
            parts.append(f"swap {cpu_grid.blocks_per_cell}/cell")
        subtitle = " · ".join(parts)
        if subtitle != self.border_subtitle:
            self.border_subtitle = subtitle

    def _legend(self) -> Text:
        counts = np.bincount(self.block_states, minlength=len(BlockState))
        parts: list[tuple[str, str] | str] = []
        for state in (BlockState.EMPTY, BlockState.CACHED, BlockState.USED, BlockState.SHARED):
            parts += [(GLYPHS[state], COLOURS[state]), f" {LEGEND_NAMES[state]} {counts[state]}  "]
        if self.cpu_block_states.size:
            num_swapped = int((self.cpu_block_states == BlockState.SWAPPED).sum())
            parts += [(GLYPHS[BlockState.SWAPPED], COLOURS[BlockState.SWAPPED]),
                      f" swapped {num_swapped}/{self.cpu_block_states.size}  "]
        if self.image_blocks:
            parts += [(IMAGE_GLYPH, f"bold {IMAGE_COLOUR}"), f" image tokens {len(self.image_blocks)}  "]
        num_free, num_cached = int(counts[BlockState.EMPTY] + counts[BlockState.CACHED]), int(counts[BlockState.CACHED])
        parts.append(f"free queue {num_free} ({num_cached} cached)")
        return Text.assemble(*parts)
