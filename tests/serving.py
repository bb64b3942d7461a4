"""Fixtures of the serving tests (imported by the test_serve_*.py files): a tiny random Llama that speaks through
SmolLM2's real tokenizer and chat template (text in, text out, at the tiny shape's speed), an AsyncLLM over it,
a live server on 127.0.0.1, and helpers to hold the engine loop still or wait for the KV pool to drain."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest

MODEL_NAME = "tiny-chat"


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig

    from conftest import build_tiny_hf
    from minillm.model.loader import convert_gguf_once, embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(convert_gguf_once(embedded_model_path()))
    path = tmp_path_factory.mktemp("tiny-chat")
    model = build_tiny_hf(LlamaConfig, seed=7, vocab_size=len(tokenizer), max_position_embeddings=512,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


ENGINE_KWARGS = dict(dtype="float32", device="cpu", batching="continuous", max_num_seqs=16, num_kv_blocks=128)


@pytest.fixture(scope="module")
def make_async_llm(tiny_chat_model_dir):
    """``make_async_llm(**overrides)``: an AsyncLLM on the tiny model, shut down at the end of the module."""
    from minillm.serve import AsyncLLM

    made = []

    def make(max_waiting_requests=None, **overrides):
        llm = AsyncLLM(str(tiny_chat_model_dir), max_waiting_requests=max_waiting_requests,
                       **{**ENGINE_KWARGS, **overrides})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown(timeout=0)


@pytest.fixture(scope="module")
def async_llm(make_async_llm):
    return make_async_llm()


@pytest.fixture(scope="module")
def server(async_llm):
    """The API on a free port of 127.0.0.1, serving the model as ``MODEL_NAME``."""
    from minillm.serve import ServerThread

    with ServerThread(async_llm, served_model_name=MODEL_NAME) as running:
        yield running


def wait_until(condition, timeout: float = 30.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def kv_pool_free(llm) -> bool:
    allocator = llm.engine.block_tables.allocator
    return allocator.num_free == allocator.num_blocks


def wait_for_empty_engine(llm, timeout: float = 30.0) -> None:
    """Every block back in the pool and no request left in the engine."""
    wait_until(lambda: kv_pool_free(llm) and not llm.engine.requests and not llm.num_running
               and not llm.num_waiting, timeout, "the engine to drain and the KV pool to be free")


@contextmanager
def engine_paused(llm):
    """Hold the engine loop before its next step, so requests pile up in the waiting queue; released on exit."""
    release = threading.Event()
    step = llm.engine.step

    def held_step():
        release.wait()
        return step()

    llm.engine.step = held_step
    try:
        yield
    finally:
        release.set()
        del llm.engine.step  # the instance attribute goes; the method shows through again


@contextmanager
def finish_reasons(llm):
    """Collect ``{request_id: finish_reason}`` of the requests that end meanwhile, through the step hook."""
    ended = {}

    def record(stats, outputs):
        ended.update((o.request_id, o.outputs[0].finish_reason) for o in outputs if o.finished)

    llm.step_callbacks.append(record)
    try:
        yield ended
    finally:
        llm.step_callbacks.remove(record)
