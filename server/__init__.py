"""An OpenAI-compatible HTTP server on the serving engine (`python -m model serve`): the engine runs on one thread of
its own (loop.py), the HTTP side (openai_api.py) only translates requests into its commands and its tokens into
OpenAI's JSON, and metrics.py writes what it measured in Prometheus' text format."""
