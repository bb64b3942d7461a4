"""Quality measurements for lossy steps: perplexity on the built-in corpus (``perplexity.py``)."""
