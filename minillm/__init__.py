"""minillm: a compact, readable LLM inference engine for learning and research.

The public surface mirrors vLLM's offline API::

    from minillm import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    print(out[0].outputs[0].text)
"""

from minillm.config import EngineConfig
from minillm.info import info
from minillm.llm import LLM
from minillm.request import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics", "EngineConfig",
           "info"]
