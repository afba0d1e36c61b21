"""Generation on top of model/'s decoder: weight providers, KV caches, sampling, speculative decoding."""
