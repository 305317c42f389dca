"""What the engine reports about a request: per sequence text, tokens, log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence (a sample or a beam)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # for n > 1, beams and when logprobs are asked for; else None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    logprobs: list[float] = field(default_factory=list)  # of each chosen token
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    delta_text: str = ""  # text added by the step that produced this output (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    """The state of one request after an engine step; `finished` once every sequence is done."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def text(self) -> str:
        """The first output's text (the only one unless n > 1)."""
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        """The first output's generated token ids."""
        return self.outputs[0].token_ids if self.outputs else []
