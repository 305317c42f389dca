"""The websocket server: routes and access checks, sessions, request parsing, response events, monitor,
metrics, and the `localserve chat` client."""
