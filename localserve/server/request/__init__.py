"""Requests: the one request model every API's generation request becomes, the field kinds and parser that
read a wire format into it, messages, sampling rules and the checks on client JSON (no I/O here)."""
