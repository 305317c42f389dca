"""Choosing the attention backend: by name or `auto`, from EngineConfig and the command line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from localserve.attention import BACKENDS, backend_class, select_backend
from localserve.attention.torch_backend import TorchAttentionBackend
from localserve.cli import main
from localserve.kv.formats import KVFormatSpec

spec = KVFormatSpec.parse  # the backends take parsed KV formats


def test_auto_picks_a_backend_that_supports_the_device_and_says_why():
    backend, why = select_backend("auto", torch.device("cpu"), spec("fp32"), spec("q4_rot"), head_dim=64)
    assert isinstance(backend, TorchAttentionBackend)
    assert why.startswith("torch (auto") and "cpu" in why


def test_a_named_backend_is_used_as_asked():
    backend, why = select_backend("torch", torch.device("cpu"), spec("fp16"), spec("q8_0"), head_dim=64)
    assert isinstance(backend, TorchAttentionBackend) and why == "torch (asked for)"


def test_an_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; known: auto, " + ", ".join(BACKENDS)):
        backend_class("flash")


def test_command_line_backend_choice(tiny_chat_model_dir, capsys):
    args = ["generate", "-m", str(tiny_chat_model_dir), "hello world", "--max-tokens", "6"]
    assert main(args + ["--attention-backend", "torch"]) == 0
    with_torch = capsys.readouterr().out
    assert main(args) == 0  # auto
    assert capsys.readouterr().out == with_torch and with_torch.strip()
    assert main(args + ["--attention-backend", "flash"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error == [f"localserve: error: unknown attention backend 'flash'; known: auto, {', '.join(BACKENDS)}"]


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize(("field", "value"), [
    ("sliding_window", 5), ("sinks", torch.linspace(-2, 2, 8)), ("logit_softcap", 3.0)])
def test_a_layer_feature_is_computed_by_both_backends(name, field, value):
    """A layer asking for a window, sinks or a soft-cap attends with it in both backends (they were refused
    by name until issue 36): the output differs from the plain layer's and equals the dense reference."""
    from localserve.attention.base import AttentionGeometry
    from tests.helpers.geometry_pools import geometry_batch

    plain = AttentionGeometry(8, 2, 64, 64 ** -0.5)
    layer = dataclasses.replace(plain, **{field: value})
    batch = geometry_batch([(1, 40), (3, 20)], layer)
    backend = backend_class(name)()
    output = backend.forward(0, batch.query, batch.key, batch.value, batch.cache,
                             backend.build_metadata(batch.inputs), layer)
    torch.testing.assert_close(output.double(), batch.expected, atol=3e-5, rtol=1e-4)
    without = geometry_batch([(1, 40), (3, 20)], plain)
    assert not torch.allclose(output.double(), without.expected, atol=1e-3)
