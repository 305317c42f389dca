"""The terminal chat client (`localserve chat`): a client of the server's `/v1/responses` websocket."""
