"""The server, grouped by purpose (docs/ARCHITECTURE.md shows the tree): the wire (`wire/`), the one request
model (`request/`), API-neutral generation (`generation/`), the model registry (`registry/`), one folder per
API family (`openai/`, `ollama/`, `anthropic/`, `llama_cpp/`, `embeddings/`), the monitor and metrics
(`monitor/`) and the web page; `app.py` and `http_app.py` put them together."""
