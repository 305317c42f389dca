"""A `MonitorSource` (server/monitor/monitor.py) that always serves one model: for the monitor's own tests."""

from __future__ import annotations

from typing import Any

from localserve.loading.sampling_defaults import LLAMA_CPP_DEFAULTS
from localserve.server.monitor.monitor import MonitorHub, ServingNow
from localserve.server.registry.served_model import ServedModel


class OneModelSource:
    """Serves the model whose engine `hub` reads, with `hello`; nothing is ever on its way."""

    def __init__(self, hub: MonitorHub, hello: dict[str, Any]) -> None:
        self.now = ServingNow(ServedModel(hello.get("model", "fake"), 512, LLAMA_CPP_DEFAULTS), None, hub, hello)

    def serving_now(self) -> ServingNow:
        return self.now

    def loading_state(self) -> None:
        return None
