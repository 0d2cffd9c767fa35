"""The OpenAI-compatible server: the engine on its own thread (``worker``), the HTTP API
(``app``), Prometheus metrics (``metrics``); ``hybrid-jax serve`` starts it."""
