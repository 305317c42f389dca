"""Why a sample stopped, as the engine reports it (engine/outputs.py re-exports it). No imports: the
sequence, the stop rules and the outputs all read it."""

from __future__ import annotations

from dataclasses import dataclass

STOP_KINDS = ("eos", "stop_token", "stop_string", "length", "abort", "error")
# The finish_reason each kind reports (the OpenAI name every API view started from).
_FINISH_REASONS = {"eos": "stop", "stop_token": "stop", "stop_string": "stop", "length": "length",
                   "abort": "abort", "error": "error"}


@dataclass(frozen=True, slots=True)
class StopReason:
    """Why a sample stopped.

    `kind`:
    - "eos": the model ended its answer: an end-of-sequence token (`token_id`; one that is also among the
      caller's stop_token_ids counts as this), or the answer format's grammar complete, nothing
      allowed after the last token (`token_id` None);
    - "stop_token": one of the caller's stop_token_ids (`token_id`), not an end-of-sequence token (or
      ignore_eos);
    - "stop_string": a stop string completed in the text (`stop_string`: which one; the text ends where
      it begins, engine/stop_rules.py);
    - "length": max_tokens or the context length reached;
    - "abort": the caller stopped it; "error": the request failed.
    """

    kind: str
    token_id: int | None = None
    stop_string: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in _FINISH_REASONS:
            raise ValueError(f"StopReason.kind must be one of {', '.join(STOP_KINDS)}; got {self.kind!r}")

    @property
    def finish_reason(self) -> str:
        """The sample's finish_reason: "stop" for eos, stop tokens and stop strings, else the kind."""
        return _FINISH_REASONS[self.kind]


LENGTH = StopReason("length")
ABORT = StopReason("abort")
ERROR = StopReason("error")
GRAMMAR_COMPLETE = StopReason("eos")
