"""``cactus-spec serve``: an OpenAI-compatible HTTP server over the batched scheduler."""
