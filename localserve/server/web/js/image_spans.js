// A request's image tokens in the monitor frames: its `image_spans` ([offset, length] of each image's prompt
// tokens, docs/PROTOCOL.md) and the KV blocks that hold them (tui/image_spans.py does the same for the TUI).
// The block at index j of a sequence's block table (group 0's: a full-attention group whenever the model has
// one) holds tokens j * blockSize .. (j + 1) * blockSize - 1; every sequence of a request shares its prompt.

/** The indices in a block table of the blocks that hold tokens of `spans`. */
export function imageBlockIndices(spans, blockSize) {
  const indices = new Set();
  for (const [offset, length] of spans) {
    for (let index = Math.floor(offset / blockSize); index <= Math.floor((offset + length - 1) / blockSize); index += 1) {
      indices.add(index);
    }
  }
  return indices;
}

/** The physical blocks of `request` (a snapshot's request entry) that hold image tokens; none from a server
 * that sends no `image_spans`. */
export function imageBlocks(request, blockSize) {
  const spans = request.image_spans ?? [];
  if (!spans.length) return [];
  const indices = imageBlockIndices(spans, blockSize);
  const blocks = new Set();
  for (const table of request.block_tables) {
    for (const index of indices) if (index < table.length) blocks.add(table[index]);
  }
  return [...blocks];
}

/** How many images a request's prompt holds, in words ("1 image", "3 images"), or "" for none. */
export function imageCount(request) {
  const count = (request.image_spans ?? []).length;
  return count ? `${count} image${count > 1 ? "s" : ""}` : "";
}
