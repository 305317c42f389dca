"""OpenAI's APIs: chat completions, completions, and Responses over HTTP and over the websocket."""
