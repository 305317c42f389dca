"""The wire: one port for HTTP and websockets, the phases of a connection, one HTTP exchange, who may connect
(nothing here knows an API, the model registry or generation)."""
