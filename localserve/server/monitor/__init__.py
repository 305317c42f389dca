"""The monitor (`/v1/monitor`, `/slots`) and the Prometheus metrics."""
