"""The model registry: the models a server serves, loaded when a request names one, and described from
their files."""
