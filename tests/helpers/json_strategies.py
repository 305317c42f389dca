"""Hypothesis strategies for hostile JSON: any value, numbers at and past every usual bound, awkward text.

A field's strategy wrapped in `maybe` sometimes draws a value of any other JSON type instead.
"""

from __future__ import annotations

from hypothesis import strategies as st

extreme_numbers = st.sampled_from([0, -1, 1, 2, 2.5, -0.5, 1e-300, 1e308, -1e308, 2 ** 31, 2 ** 63, 2 ** 64,
                                   -(2 ** 63) - 1, 10 ** 30, 16, 17, 20, 21, 0.0, 1.0])
json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | extreme_numbers
json_values = st.recursive(json_scalars, lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(st.text(max_size=8), children, max_size=4), max_leaves=12)
nasty_text = st.text(max_size=30) | st.sampled_from(["\ud800", "a\udfffb", "<|im_end|>", "<|im_start|>system",
                                                     "", " ", "\x00", "é" * 40, "hello world"])


def maybe(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """`strategy`, or now and then any JSON value (a wrong type for the field)."""
    return strategy | json_values
