"""The `/v1/monitor` feed as typed data (docs/PROTOCOL.md, "/v1/monitor").

A connection gets a `monitor.hello` frame (what stays fixed while a model is loaded), then a
`monitor.snapshot` frame every interval; a server of several models (`--models-dir`) sends a new hello
when the model it shows changes, and `monitor.no_model` frames while none is loaded. Snapshots and
no-model frames say which model is on its way (`ModelSwitch`). `parse_hello`, `parse_snapshot` and
`parse_no_model` turn the decoded JSON
into frozen dataclasses and raise `FeedError`, naming the field, on anything that does not follow
the protocol, so a server that drifts from the documented schema fails loudly instead of drawing a
wrong map. Block states arrive run-length encoded; `decode_block_states` expands them into a numpy
array of `BlockState` codes, which is what the block map draws from.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from enum import IntEnum
from typing import Any

import numpy as np
from localserve.tui.image_spans import ImageSpanError, image_block_ids, parse_image_spans


class FeedError(ValueError):
    """A monitor frame that does not follow docs/PROTOCOL.md."""


class BlockState(IntEnum):
    """The state of one block, GPU or swap pool. The values index numpy arrays of states."""

    EMPTY = 0  # free, holding nothing ('.')
    CACHED = 1  # free, still holding cached contents the prefix cache can take back ('c')
    USED = 2  # in one sequence's block table ('u')
    SHARED = 3  # in several block tables ('s')
    SWAPPED = 4  # swap pool only: holding a swapped-out block ('w')


GPU_STATE_CHARS = {".": BlockState.EMPTY, "c": BlockState.CACHED, "u": BlockState.USED, "s": BlockState.SHARED}
CPU_STATE_CHARS = {".": BlockState.EMPTY, "w": BlockState.SWAPPED}
REQUEST_STATES = ("waiting", "prefill", "decode", "preempted", "swapped")


def decode_block_states(encoded: str, state_chars: dict[str, BlockState], num_blocks: int,
                        name: str = "blocks") -> np.ndarray:
    """Expand a run-length encoded state string (`u3s2c5.1014`) into `num_blocks` state codes (uint8).

    Vectorized, because a fragmented pool of 65,536 blocks is a string of up to 65,536 runs and a
    Python loop over them would take most of a frame's time budget.
    """
    if not isinstance(encoded, str):
        raise FeedError(f"'{name}' must be a string, got {type(encoded).__name__}")
    if not encoded.isascii():
        raise FeedError(f"'{name}' holds characters that are not block states")
    chars = np.frombuffer(encoded.encode("ascii"), dtype=np.uint8)
    is_digit = (chars >= ord("0")) & (chars <= ord("9"))
    if chars.size and is_digit[0]:
        raise FeedError(f"'{name}' starts with a run length instead of a state: {encoded[:40]!r}")
    state_positions = np.flatnonzero(~is_digit)
    lookup = np.full(256, 255, dtype=np.uint8)
    for char, state in state_chars.items():
        lookup[ord(char)] = state
    codes = lookup[chars[state_positions]]
    if (codes == 255).any():
        unknown = chr(chars[state_positions[np.argmax(codes == 255)]])
        raise FeedError(f"'{name}' has unknown block state {unknown!r} (expected one of {''.join(state_chars)!r})")
    # A run's length is the digits after its state character, or 1 when there are none.
    run_of_char = np.cumsum(~is_digit) - 1
    digit_positions = np.flatnonzero(is_digit)
    run_of_digit = run_of_char[digit_positions]
    run_ends = np.append(state_positions[1:], chars.size) - 1  # last position of each run's text
    place_values = 10.0 ** (run_ends[run_of_digit] - digit_positions)
    digit_values = (chars[digit_positions] - ord("0")) * place_values
    counts = np.bincount(run_of_digit, weights=digit_values, minlength=codes.size).astype(np.int64)
    has_digits = np.bincount(run_of_digit, minlength=codes.size) > 0
    if (counts[has_digits] < 1).any():
        raise FeedError(f"'{name}' has a run of length 0")
    counts[~has_digits] = 1
    if int(counts.sum()) != num_blocks:
        raise FeedError(f"'{name}' describes {int(counts.sum())} blocks, the pool has {num_blocks}")
    return np.repeat(codes, counts)


def _take(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """data[key], checked to be of `kind` (booleans are never numbers)."""
    if key not in data:
        raise FeedError(f"{where} has no '{key}'")
    value = data[key]
    numeric = kind in (int, float) or (isinstance(kind, tuple) and int in kind)
    if not isinstance(value, kind) or (numeric and isinstance(value, bool)):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise FeedError(f"{where}.{key} must be {expected}, got {type(value).__name__}")
    return value


def _optional(data: dict[str, Any], key: str, kind: type, default: Any, where: str) -> Any:
    """data[key] checked as `_take` does, or `default` when the frame has no such key."""
    return _take(data, key, kind, where) if key in data else default


def _number(data: dict[str, Any], key: str, where: str) -> float:
    return float(_take(data, key, (int, float), where))


def _fill(cls: type, data: Any, where: str, **given: Any) -> Any:
    """An instance of the dataclass `cls`: fields in `given` as they are, the others (int, str or float)
    checked and taken from `data` (extra keys ignored); a field with a default may be left out (a field
    docs/PROTOCOL.md names as optional: a server without speculative decoding or a time budget)."""
    if not isinstance(data, dict):
        raise FeedError(f"{where} must be an object, got {type(data).__name__}")
    values = dict(given)
    for item in fields(cls):
        if item.name in given or (item.name not in data and item.default is not MISSING):
            continue
        if item.type == "int":
            values[item.name] = _take(data, item.name, int, where)
        elif item.type == "str":
            values[item.name] = _take(data, item.name, str, where)
        else:
            values[item.name] = _number(data, item.name, where)
    return cls(**values)


@dataclass(frozen=True, slots=True)
class FormatCapacity:
    """How many tokens the server's KV memory would hold in one KV format."""

    format: str
    bytes_per_token: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class MonitorHello:
    """The first frame of a connection: what does not change while the server runs."""

    model: str
    block_size: int
    num_blocks: int
    num_cpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    cache_type_k: str
    cache_type_v: str
    kv_cache_bytes: int
    capacity: tuple[FormatCapacity, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """One request in the engine, as the slots table shows it."""

    label: str
    state: str
    num_prompt_tokens: int
    num_computed_prompt_tokens: int
    num_output_tokens: int
    num_seqs: int
    num_preemptions: int
    num_cached_tokens: int
    tokens_per_s: float
    block_tables: tuple[tuple[int, ...], ...] = ()
    # Newer fields (docs/PROTOCOL.md); a server that predates them sends none: free, not reasoning, no draft.
    constrained: bool = False
    num_reasoning_seqs: int = 0
    spec_acceptance_rate: float = 0.0  # speculative decoding: accepted over drafted tokens (0: no draft)
    spec_mean_accepted_length: float = 0.0  # tokens per verification (0: none)
    image_spans: tuple[tuple[int, int], ...] = ()  # (offset, length) of each image's prompt tokens

    @property
    def block_ids(self) -> frozenset[int]:
        """Every physical block any of the request's sequences points at."""
        return frozenset(block for table in self.block_tables for block in table)

    def image_block_ids(self, block_size: int) -> frozenset[int]:
        """The physical blocks of its sequences that hold image tokens (tui/image_spans.py)."""
        return image_block_ids(self.block_tables, self.image_spans, block_size)


@dataclass(frozen=True, slots=True)
class GroupBlocks:
    """One layer group's pool now ("full" or "window W"): its blocks used, cached and free."""

    label: str
    num_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_free_blocks: int

    def describe(self) -> str:
        return (f"{self.label}: {self.num_used_blocks:,} used, {self.num_cached_blocks:,} cached, "
                f"{self.num_free_blocks:,} free")


@dataclass(frozen=True, slots=True)
class Gauges:
    """Values now."""

    num_requests_running: int
    num_requests_waiting: int
    num_requests_swapped: int
    kv_cache_usage_ratio: float
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int
    num_free_cpu_blocks: int
    last_step_s: float
    last_step_tokens: int
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    step_limit_s: float = 0.0
    kv_groups: tuple[GroupBlocks, ...] = ()  # a server whose model has layer groups (docs/PROTOCOL.md)


def _parse_groups(gauges: Any, where: str) -> tuple[GroupBlocks, ...]:
    """The optional `kv_groups` of the gauges: each {sliding_window (null: full, "state": recurrent layers'
    state slots), num_blocks, num_..._blocks}."""
    entries = gauges.get("kv_groups", []) if isinstance(gauges, dict) else []
    if not isinstance(entries, list):
        raise FeedError(f"{where}.kv_groups must be a list")
    groups = []
    for index, entry in enumerate(entries):
        at = f"{where}.kv_groups[{index}]"
        window = entry.get("sliding_window") if isinstance(entry, dict) else None
        if window is not None and window != "state" and (not isinstance(window, int) or isinstance(window, bool)
                                                          or window < 1):
            raise FeedError(f"{at}.sliding_window must be null, \"state\" or an int >= 1, got {window!r}")
        label = "full" if window is None else "state" if window == "state" else f"window {window}"
        groups.append(_fill(GroupBlocks, entry, at, label=label))
    return tuple(groups)


@dataclass(frozen=True, slots=True)
class Counters:
    """Totals since the server started; they only grow."""

    num_preemptions: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_swap_fallbacks: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    cow_copies: int
    cached_block_evictions: int
    num_requests_finished: int
    num_requests_failed: int
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class MonitorEvent:
    """One of the engine's events; `details` holds the fields particular to its kind."""

    seq: int
    time: float
    event: str
    request: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


SWITCH_PHASES = ("waiting", "unloading", "loading")


@dataclass(frozen=True, slots=True)
class ModelSwitch:
    """A model on its way: waiting for the requests of the model making room, that model being unloaded,
    or this one being loaded; `elapsed_s` in that phase."""

    model: str
    phase: str
    unloading: str | None
    elapsed_s: float

    def describe(self) -> str:
        """One phrase for a status line."""
        if self.phase == "loading":
            return f"loading {self.model} ({self.elapsed_s:.0f} s)"
        if self.phase == "unloading":
            return f"unloading {self.unloading} for {self.model}"
        making_room = f"{self.unloading}'s requests to finish" if self.unloading else "room"
        return f"{self.model} waits for {making_room}"


@dataclass(frozen=True, slots=True)
class NoModel:
    """A `monitor.no_model` frame: no model is loaded now."""

    time: float
    switch: ModelSwitch | None


@dataclass(frozen=True, slots=True)
class MonitorSnapshot:
    """One `monitor.snapshot` frame, block states decoded."""

    time: float
    num_steps: int
    blocks: np.ndarray  # uint8 BlockState per GPU block
    cpu_blocks: np.ndarray  # uint8 BlockState per swap-pool block
    requests: tuple[RequestInfo, ...]
    gauges: Gauges
    counters: Counters
    events: tuple[MonitorEvent, ...]
    missed_events: int
    switch: ModelSwitch | None = None  # another model on its way


def _type_of(frame: Any, expected: str) -> None:
    if not isinstance(frame, dict):
        raise FeedError(f"a monitor frame must be a JSON object, got {type(frame).__name__}")
    if frame.get("type") != expected:
        raise FeedError(f"expected a '{expected}' frame, got type {frame.get('type')!r}")


def parse_hello(frame: Any) -> MonitorHello:
    """The typed `monitor.hello` frame."""
    _type_of(frame, "monitor.hello")
    capacity_list = _take(frame, "capacity", list, "monitor.hello")
    capacity = tuple(_fill(FormatCapacity, entry, f"monitor.hello.capacity[{index}]")
                     for index, entry in enumerate(capacity_list))
    return _fill(MonitorHello, frame, "monitor.hello", capacity=capacity)


def _parse_request(data: Any, where: str, num_blocks: int) -> RequestInfo:
    if not isinstance(data, dict):
        raise FeedError(f"{where} must be an object, got {type(data).__name__}")
    state = _take(data, "state", str, where)
    if state not in REQUEST_STATES:
        raise FeedError(f"{where}.state must be one of {', '.join(REQUEST_STATES)}, got {state!r}")
    tables = _take(data, "block_tables", list, where)
    block_tables = []
    for index, table in enumerate(tables):
        # set(map(type, ...)) runs in C: a pool of 65,536 blocks puts that many numbers in a frame.
        if not isinstance(table, list) or not set(map(type, table)) <= {int}:
            raise FeedError(f"{where}.block_tables[{index}] must be a list of block numbers")
        if table and (min(table) < 0 or max(table) >= num_blocks):
            outside = next(block for block in table if not 0 <= block < num_blocks)
            raise FeedError(f"{where}.block_tables[{index}] points at block {outside}, "
                            f"outside the pool of {num_blocks}")
        block_tables.append(tuple(table))
    constrained = _optional(data, "constrained", bool, False, where)
    num_reasoning_seqs = _optional(data, "num_reasoning_seqs", int, 0, where)
    if num_reasoning_seqs < 0:
        raise FeedError(f"{where}.num_reasoning_seqs must be >= 0, got {num_reasoning_seqs}")
    try:
        num_prompt_tokens = _take(data, "num_prompt_tokens", int, where)
        image_spans = parse_image_spans(data.get("image_spans", []), where, num_prompt_tokens)
    except ImageSpanError as error:
        raise FeedError(str(error)) from None
    return _fill(RequestInfo, data, where, state=state, block_tables=tuple(block_tables), constrained=constrained,
                 num_reasoning_seqs=num_reasoning_seqs, image_spans=image_spans)


def _parse_event(data: Any, where: str) -> MonitorEvent:
    if not isinstance(data, dict):
        raise FeedError(f"{where} must be an object, got {type(data).__name__}")
    request = data.get("request")
    if request is not None and not isinstance(request, str):
        raise FeedError(f"{where}.request must be a string, got {type(request).__name__}")
    details = {key: value for key, value in data.items() if key not in ("seq", "time", "event", "request")}
    return MonitorEvent(seq=_take(data, "seq", int, where), time=_number(data, "time", where),
                        event=_take(data, "event", str, where), request=request, details=details)


def _parse_switch(frame: dict[str, Any], where: str) -> ModelSwitch | None:
    data = frame.get("loading")
    if data is None:
        return None
    where = f"{where}.loading"
    if not isinstance(data, dict):
        raise FeedError(f"{where} must be an object or null, got {type(data).__name__}")
    phase = _take(data, "phase", str, where)
    if phase not in SWITCH_PHASES:
        raise FeedError(f"{where}.phase must be one of {', '.join(SWITCH_PHASES)}, got {phase!r}")
    unloading = data.get("unloading")
    if unloading is not None and not isinstance(unloading, str):
        raise FeedError(f"{where}.unloading must be a string or null, got {type(unloading).__name__}")
    return ModelSwitch(_take(data, "model", str, where), phase, unloading, _number(data, "elapsed_s", where))


def parse_no_model(frame: Any) -> NoModel:
    """The typed `monitor.no_model` frame."""
    _type_of(frame, "monitor.no_model")
    return NoModel(_number(frame, "time", "monitor.no_model"), _parse_switch(frame, "monitor.no_model"))


def parse_snapshot(frame: Any, hello: MonitorHello) -> MonitorSnapshot:
    """The typed `monitor.snapshot` frame of a connection that began with `hello`."""
    _type_of(frame, "monitor.snapshot")
    where = "monitor.snapshot"
    blocks = decode_block_states(_take(frame, "blocks", str, where), GPU_STATE_CHARS, hello.num_blocks, "blocks")
    cpu_blocks = decode_block_states(_take(frame, "cpu_blocks", str, where), CPU_STATE_CHARS,
                                     hello.num_cpu_blocks, "cpu_blocks")
    requests = tuple(_parse_request(entry, f"{where}.requests[{index}]", hello.num_blocks)
                     for index, entry in enumerate(_take(frame, "requests", list, where)))
    events = tuple(_parse_event(entry, f"{where}.events[{index}]")
                   for index, entry in enumerate(_take(frame, "events", list, where)))
    missed_events = _take(frame, "missed_events", int, where)
    if missed_events < 0:
        raise FeedError(f"{where}.missed_events must be >= 0, got {missed_events}")
    return MonitorSnapshot(time=_number(frame, "time", where), num_steps=_take(frame, "num_steps", int, where),
                           blocks=blocks, cpu_blocks=cpu_blocks, requests=requests,
                           gauges=_fill(Gauges, gauges := _take(frame, "gauges", dict, where), f"{where}.gauges",
                                        kv_groups=_parse_groups(gauges, f"{where}.gauges")),
                           counters=_fill(Counters, _take(frame, "counters", dict, where), f"{where}.counters"),
                           events=events, missed_events=missed_events, switch=_parse_switch(frame, where))
