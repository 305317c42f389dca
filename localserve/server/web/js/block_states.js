// Block states as /v1/monitor sends them (docs/PROTOCOL.md, "/v1/monitor"), with the TUI's meanings and
// colours (tui/feed.py BlockState, tui/block_map.py COLOURS): the same pool reads the same in both.

export const EMPTY = 0; // free, holding nothing ('.')
export const CACHED = 1; // free, still holding cached contents the prefix cache can take back ('c')
export const USED = 2; // in one sequence's block table ('u')
export const SHARED = 3; // in several block tables ('s')
export const SWAPPED = 4; // swap pool only: holding a swapped-out block ('w')
export const NUM_STATES = 5;

export const GPU_STATE_CHARS = { ".": EMPTY, c: CACHED, u: USED, s: SHARED };
export const CPU_STATE_CHARS = { ".": EMPTY, w: SWAPPED };
export const STATE_NAMES = ["free", "cached", "used", "shared", "swapped"];
export const STATE_CLASSES = ["state-empty", "state-cached", "state-used", "state-shared", "state-swapped"];
export const STATE_COLOURS = ["#585858", "#5f87d7", "#5faf5f", "#d75fd7", "#d7875f"];
export const SELECTED_COLOUR = "#ffff00"; // the selected request's own blocks
export const SELECTED_SHARED_COLOUR = "#d7d700"; // ... and those it shares
export const IMAGE_COLOUR = "#00d7d7"; // ... and those that hold image tokens (tui/block_map.py IMAGE_COLOUR)
export const BACKGROUND_COLOUR = "#101010";
// Majority vote order when a cell stands for several blocks: on a tie the first of these wins.
export const BUSIEST_FIRST = [SHARED, USED, SWAPPED, CACHED, EMPTY];

/**
 * `encoded` (`u3s2c5.1014`: a state character, then its run length unless 1) expanded into `numBlocks`
 * state codes, written into `into` when it has that length (a frame reuses its array: no garbage per frame).
 * Throws on anything that does not describe exactly `numBlocks` blocks in the given states.
 */
export function decodeBlockStates(encoded, stateChars, numBlocks, into = null) {
  const states = into && into.length === numBlocks ? into : new Uint8Array(numBlocks);
  const lookup = new Int8Array(128).fill(-1);
  for (const [char, state] of Object.entries(stateChars)) lookup[char.charCodeAt(0)] = state;
  let position = 0;
  let index = 0;
  while (index < encoded.length) {
    const code = encoded.charCodeAt(index);
    const state = code < 128 ? lookup[code] : -1;
    if (state < 0) throw new Error(`unknown block state ${JSON.stringify(encoded[index])} at ${index}`);
    index += 1;
    let length = 0;
    let digits = 0;
    for (let digit; index < encoded.length && (digit = encoded.charCodeAt(index) - 48) >= 0 && digit <= 9; index += 1) {
      length = length * 10 + digit;
      digits += 1;
    }
    if (digits === 0) length = 1;
    if (length < 1) throw new Error("a run of length 0");
    if (position + length > numBlocks) throw new Error(`the states describe more than the pool's ${numBlocks} blocks`);
    states.fill(state, position, position + length);
    position += length;
  }
  if (position !== numBlocks) throw new Error(`the states describe ${position} blocks, the pool has ${numBlocks}`);
  return states;
}

/** How many blocks are in each state. */
export function countStates(states) {
  const counts = new Array(NUM_STATES).fill(0);
  for (let index = 0; index < states.length; index += 1) counts[states[index]] += 1;
  return counts;
}
