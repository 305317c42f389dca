// The block map: every KV block a square on a canvas, coloured by its state (tui/block_map.py's colours).
//
// Cells are laid out row by row, as large as the canvas allows for the pool (a 1-pixel gap between cells
// of 4 pixels or more). When the pool has more blocks than the canvas has pixels, a cell stands for
// `blocksPerCell` consecutive blocks and shows the state most of them are in (ties go to the busier
// state, as in the TUI). The selected request's blocks are yellow (its own) and dark yellow (shared), and
// cyan where they hold image tokens (a cell with any such block is cyan).
// Each frame is drawn into one ImageData kept from frame to frame: no allocation per frame.

import {
  BACKGROUND_COLOUR, BUSIEST_FIRST, IMAGE_COLOUR, NUM_STATES, SELECTED_COLOUR, SELECTED_SHARED_COLOUR, SHARED,
  STATE_COLOURS,
} from "./block_states.js";

const SELECTED = NUM_STATES; // colour indices after the states
const SELECTED_SHARED = NUM_STATES + 1;
const SELECTED_IMAGE = NUM_STATES + 2;

function rgba(hex) { // as one little-endian Uint32 pixel of an ImageData
  const value = parseInt(hex.slice(1), 16);
  return (0xff << 24 | (value & 0xff) << 16 | (value >> 8 & 0xff) << 8 | value >> 16) >>> 0;
}

const PALETTE = Uint32Array.from([...STATE_COLOURS, SELECTED_COLOUR, SELECTED_SHARED_COLOUR, IMAGE_COLOUR].map(rgba));
const BACKGROUND = rgba(BACKGROUND_COLOUR);

/** Cell size and grid for `numCells` cells on a `width` x `height` pixel canvas. */
export function layoutCells(numBlocks, width, height) {
  const capacity = Math.max(1, width * height);
  const blocksPerCell = Math.max(1, Math.ceil(numBlocks / capacity));
  const numCells = Math.ceil(numBlocks / blocksPerCell);
  let pitch = Math.max(1, Math.floor(Math.sqrt(capacity / Math.max(1, numCells))));
  while (pitch > 1 && Math.floor(width / pitch) * Math.floor(height / pitch) < numCells) pitch -= 1;
  const columns = Math.max(1, Math.floor(width / pitch));
  return { blocksPerCell, numCells, pitch, columns, rows: Math.ceil(numCells / columns),
    cellSize: pitch >= 4 ? pitch - 1 : pitch };
}

export class BlockMap {
  constructor(canvas) {
    this.canvas = canvas;
    this.context = canvas.getContext("2d");
    this.states = new Uint8Array(0);
    this.selected = new Uint8Array(0); // 1: the selected request's block, 2: ... holding image tokens
    this.cellColours = new Uint8Array(0); // the colour index each cell was drawn in
    this.image = null;
    this.layout = null;
  }

  /** Draw `states` (Uint8Array of block states) with `selectedBlocks` (block numbers) highlighted, those of
   * them in `imageBlocks` as holding image tokens. */
  show(states, selectedBlocks = [], imageBlocks = []) {
    this.states = states;
    if (this.selected.length !== states.length) this.selected = new Uint8Array(states.length);
    else this.selected.fill(0);
    for (const block of selectedBlocks) if (block >= 0 && block < states.length) this.selected[block] = 1;
    for (const block of imageBlocks) if (this.selected[block]) this.selected[block] = 2;
    this.draw();
  }

  /** Fit the canvas's bitmap to its size on screen (call when that changes), then redraw. */
  resize() {
    const ratio = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.round(this.canvas.clientWidth * ratio));
    const height = Math.max(1, Math.round(this.canvas.clientHeight * ratio));
    if (width !== this.canvas.width || height !== this.canvas.height) {
      this.canvas.width = width;
      this.canvas.height = height;
      this.image = null;
    }
    this.draw();
  }

  draw() {
    const { width, height } = this.canvas;
    if (!this.image || this.image.width !== width || this.image.height !== height) {
      this.image = this.context.createImageData(width, height);
      this.pixels = new Uint32Array(this.image.data.buffer);
    }
    const layout = layoutCells(this.states.length, width, height);
    this.layout = layout;
    if (this.cellColours.length !== layout.numCells) this.cellColours = new Uint8Array(layout.numCells);
    this.colourCells(layout);
    const pixels = this.pixels;
    pixels.fill(BACKGROUND);
    const { pitch, columns, cellSize, numCells } = layout;
    // One pixel row of a row of cells is built, then copied into each of the cell's pixel rows.
    if (!this.line || this.line.length !== width) this.line = new Uint32Array(width);
    const line = this.line;
    for (let first = 0, y = 0; first < numCells && y + cellSize <= height; first += columns, y += pitch) {
      line.fill(BACKGROUND);
      const end = Math.min(numCells, first + columns);
      if (cellSize === 1) {
        for (let cell = first; cell < end; cell += 1) line[cell - first] = PALETTE[this.cellColours[cell]];
      } else {
        for (let cell = first, x = 0; cell < end; cell += 1, x += pitch) {
          line.fill(PALETTE[this.cellColours[cell]], x, x + cellSize);
        }
      }
      for (let row = 0; row < cellSize; row += 1) pixels.set(line, (y + row) * width);
    }
    this.context.putImageData(this.image, 0, 0);
    Object.assign(this.canvas.dataset, { columns, pitch, cellSize, blocksPerCell: layout.blocksPerCell,
      numCells: layout.numCells });
  }

  colourCells({ blocksPerCell, numCells }) {
    const { states, selected, cellColours } = this;
    if (blocksPerCell === 1) {
      for (let block = 0; block < states.length; block += 1) {
        cellColours[block] = selected[block] === 2 ? SELECTED_IMAGE
          : selected[block] ? (states[block] === SHARED ? SELECTED_SHARED : SELECTED) : states[block];
      }
      return;
    }
    const counts = new Uint32Array(NUM_STATES);
    for (let cell = 0; cell < numCells; cell += 1) {
      counts.fill(0);
      let anySelected = false;
      let selectedShared = false;
      let anyImage = false;
      const end = Math.min(states.length, (cell + 1) * blocksPerCell);
      for (let block = cell * blocksPerCell; block < end; block += 1) {
        counts[states[block]] += 1;
        if (selected[block]) {
          anySelected = true;
          selectedShared ||= states[block] === SHARED;
          anyImage ||= selected[block] === 2;
        }
      }
      let best = BUSIEST_FIRST[0];
      for (const state of BUSIEST_FIRST) if (counts[state] > counts[best]) best = state;
      cellColours[cell] = anyImage ? SELECTED_IMAGE : anySelected ? (selectedShared ? SELECTED_SHARED : SELECTED) : best;
    }
  }

  /** The blocks under the canvas pixel (x, y) in CSS pixels: [first, end), or null off the cells. */
  blocksAt(x, y) {
    if (!this.layout) return null;
    const ratio = this.canvas.width / Math.max(1, this.canvas.clientWidth);
    const { pitch, columns, numCells, blocksPerCell } = this.layout;
    const column = Math.floor((x * ratio) / pitch);
    const cell = Math.floor((y * ratio) / pitch) * columns + column;
    if (column >= columns || cell < 0 || cell >= numCells) return null;
    return [cell * blocksPerCell, Math.min(this.states.length, (cell + 1) * blocksPerCell)];
  }
}
