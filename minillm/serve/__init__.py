"""Serving: ``AsyncLLM`` (the engine driven by a background thread, for async code) and the OpenAI-compatible
HTTP server over it (``minillm serve``). Not imported by ``import minillm``: FastAPI and uvicorn load only here.

    from minillm.serve import AsyncLLM, ServerThread
    llm = AsyncLLM(max_waiting_requests=64)
    server = ServerThread(llm, port=8000)          # http://127.0.0.1:8000/v1, for the openai client
"""

from minillm.serve.async_llm import AsyncLLM, EngineShutdownError, QueueFullError, RequestStream
from minillm.serve.launcher import ServerThread, run_server

__all__ = ["AsyncLLM", "EngineShutdownError", "QueueFullError", "RequestStream", "ServerThread", "run_server"]
