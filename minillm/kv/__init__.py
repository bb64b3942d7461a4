"""KV-cache layouts: where each token's keys and values live between steps."""
