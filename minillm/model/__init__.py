"""The Llama-family decoder and the code that fills it with weights."""
