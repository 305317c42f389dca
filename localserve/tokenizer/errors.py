"""The tokenizer's error type."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used; the message names the file and the problem."""
