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
@pytest.mark.parametrize(("field", "value", "feature"), [
    ("sliding_window", 4096, "a sliding window"), ("sinks", torch.zeros(8), "attention sinks"),
    ("logit_softcap", 30.0, "a logit soft-cap")])
def test_a_layer_feature_no_backend_computes_yet_is_refused_by_name(name, field, value, feature):
    """Until the backends compute them (the next issue), a layer asking for a window, sinks or a soft-cap is
    refused naming the feature, before anything is written to the pool; the same layer without it attends."""
    from localserve.attention.base import AttentionGeometry
    from tests.helpers.kv_pools import fill_batch

    batch = fill_batch([(1, 20)], "bf16", "bf16", 8, 2, 64)
    backend = backend_class(name)()
    plain = AttentionGeometry(8, 2, 64, 64 ** -0.5)
    before = [store.clone() for store in batch.cache.key_stores[0].values()]
    with pytest.raises(NotImplementedError, match=f"the {name} attention backend does not compute {feature} yet"):
        backend.forward(0, batch.query, batch.key, batch.value, batch.cache, backend.build_metadata(batch.inputs),
                        dataclasses.replace(plain, **{field: value}))
    assert all(torch.equal(a, b) for a, b in zip(before, batch.cache.key_stores[0].values(), strict=True))
    output = backend.forward(0, batch.query, batch.key, batch.value, batch.cache,
                             backend.build_metadata(batch.inputs), plain)
    default = backend.forward(0, batch.query, batch.key, batch.value, batch.cache,
                              backend.build_metadata(batch.inputs))  # the usual 1/sqrt(D), nothing else
    assert torch.equal(output, default)
