"""The models a server serves (server/models.py's ModelRegistry), on its own: the names a model answers to
and the 404 naming what is served; leases, loads and unloads in arrival order, played with fake loads."""

from __future__ import annotations

import json

import pytest

from localserve.loading.sampling_defaults import SamplingDefaults
from localserve.server.models import serving_loaded
from localserve.server.validation import ProtocolError
from tests.helpers.engine_access import CountingTokenizer, RecordedEngineThread


def one_model(defaults: SamplingDefaults | None = None):
    return serving_loaded(RecordedEngineThread(max_model_len=512), CountingTokenizer(), "own-name", alias="alias",
                          sampling_defaults=defaults or SamplingDefaults(0.5, source="test"))


def test_the_served_model_answers_to_its_names():
    defaults = SamplingDefaults(0.5, top_k=3, source="test")
    models = one_model(defaults)
    entry = models.find("alias")
    for name in (None, "default", "alias", "own-name"):
        assert models.find(name) is entry
    with pytest.raises(ProtocolError) as raised:
        models.find("gpt-4o")
    assert (raised.value.code, raised.value.param, raised.value.status) == ("model_not_found", "model", 404)
    assert "alias" in raised.value.message
    assert models.describe(entry) == {"id": "alias", "object": "model", "created": 0, "owned_by": "localserve",
                                      "status": "loaded", "names": ["alias", "own-name", "default"],
                                      "max_model_len": 512, "sampling_defaults": defaults.to_json()}


@pytest.mark.parametrize("name", ["Alias", "alias ", " alias", "alia", "aliases", "own-name-2", "own", "Default",
                                  "", "alias/own-name"])
def test_a_near_miss_of_a_served_name_is_a_404_naming_both(name):
    with pytest.raises(ProtocolError) as raised:
        one_model().find(name)
    assert (raised.value.code, raised.value.param, raised.value.status) == ("model_not_found", "model", 404)
    assert f"model {json.dumps(name)} is not served" in raised.value.message  # what was asked, as JSON shows it
    assert "serves 'alias'" in raised.value.message


def test_the_404_shows_a_long_name_cut():
    with pytest.raises(ProtocolError) as raised:
        one_model().find("m" * 5000)
    assert '"' + "m" * 79 + "..." in raised.value.message and len(raised.value.message) < 300
