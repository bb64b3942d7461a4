"""Weight quantization: RTN, GPTQ, AWQ (INT4 / INT8) and FP8, by swapping modules (``quantize_model``).

``spec.py`` names the methods; ``rtn.py`` is the grid they share; ``gptq.py``, ``awq.py`` and
``fp8.py`` the methods; ``calibration.py`` feeds GPTQ and AWQ activations layer by layer;
``linear.py`` holds the packed runtime layout; ``checkpoint.py`` saves and loads it (GPTQ v1).
"""
