"""Model definitions (imported as `localserve.models`). Every supported architecture is served by the one
Llama-family implementation in `llama.py`; `config.py` holds the configuration it is built from.

Nothing heavy is imported here: import `localserve.models.llama` for the model itself.
"""
