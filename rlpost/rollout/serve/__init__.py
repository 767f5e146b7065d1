"""``rlpost serve``: the OpenAI-compatible app, its guards, sessions and routes."""
