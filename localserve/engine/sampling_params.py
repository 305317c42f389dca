"""Sampling parameters of one request, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from localserve.engine.grammar import GrammarSpec


@dataclass(slots=True)
class SamplingParams:
    """How to pick the next token, and when to stop.

    `temperature == 0` is greedy decoding. `top_k=None`, `top_p=1.0` and `min_p=0.0` switch those
    filters off. `n` sequences are sampled from one prompt (they share its KV blocks); with
    `beam_search=True` they are the `n` beams of a beam search instead.

    The next token's logits go through, in this order: the repetition penalty (each token of the
    prompt or the output once, as transformers), the presence and frequency penalties (on the output's
    token counts, as OpenAI), then temperature, top-k, top-p and min-p (as transformers'
    `generate`; see `sampler.filter_logits`). Greedy takes the argmax after the penalties.

    `logprobs` (0-20) asks for the log-probability of each chosen token and that many most likely
    alternatives. They are taken after the penalties and before temperature and the filters: the
    log-softmax of the penalized logits, so they do not change with temperature, top-k, top-p or min-p,
    and a filtered-out alternative keeps its probability rather than -inf. (vLLM documents the same
    kind of choice as its `logprobs_mode`; its default is the raw logits, before the penalties too.)

    Stopping: an end-of-sequence id of the model (config.json, generation_config.json; unless
    `ignore_eos`) or one of `stop_token_ids` ends the sequence with reason "stop": its id is the last
    of the token ids, its text is left out. A stop string ends it at the token that completes it (no
    token after that one); the text ends before the first stop string to be completed (the longest
    of those completed at the same character). `max_tokens`, or the end of the context, ends it with
    reason "length".

    `grammar` (engine/grammar.py's `GrammarSpec`) constrains the output: each token is sampled from
    those the grammar allows (the mask comes before the penalties and the filters), an end-of-sequence
    token only where the grammar is complete, and a sequence whose grammar is complete ends there with
    reason "stop". A stop string, a stop token the grammar allows, or the length limit can still end
    it first ("stop", "stop", "length"). Not with beam_search. `reasoning_end` (e.g. "</think>") is the
    text that ends the model's reasoning block: the output before it is reasoning, where no grammar
    applies; the grammar starts after it. It needs the marker as text the detokenizer shows.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    beam_search: bool = False
    logprobs: int | None = None
    grammar: GrammarSpec | None = None
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_k", self.top_k is None or self.top_k >= 1, "must be >= 1 (or None to disable)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p < 1, "must be in [0, 1)"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("n", self.n >= 1, "must be >= 1"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            # Beams are detokenized only when the search ends, so no stop string could ever be seen.
            ("stop", not (self.stop and self.beam_search), "is not supported with beam_search"),
            ("grammar", self.grammar is None or isinstance(self.grammar, GrammarSpec), "must be a GrammarSpec"),
            # A beam step ranks candidates over the whole vocabulary and forks beams mid-way.
            ("grammar", not (self.grammar is not None and self.beam_search), "is not supported with beam_search"),
            ("reasoning_end", self.reasoning_end is None or (isinstance(self.reasoning_end, str)
                                                             and self.reasoning_end), "must be a non-empty string"),
            ("reasoning_end", not (self.reasoning_end and self.beam_search), "is not supported with beam_search"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        """True when the next token is always the most likely one."""
        return self.temperature == 0
