"""The server under load on 127.0.0.1: many concurrent streams all complete with the right tokens and leave the KV
pool free; clients that disconnect (streaming or not) get their requests aborted and their blocks freed; a
server that stops lets the requests in flight finish, or aborts them once its shutdown timeout has passed; and
`minillm serve` itself, stopped by SIGTERM, finishes its requests and exits cleanly."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from minillm import LLM, SamplingParams
from minillm.serve import ServerThread
from serving import (ENGINE_KWARGS, MODEL_NAME, async_llm, finish_reasons, kv_pool_free,  # noqa: F401
                     make_async_llm, server, tiny_chat_model_dir, wait_for_empty_engine, wait_until)

PROMPTS = ["The quick brown fox", "In the beginning", "import numpy as np", "Dear Sir or Madam,",
           "Roses are red,", "Once upon a time", "The answer is", "SELECT * FROM"]
NUM_REQUESTS, NUM_CLIENTS = 200, 32


def max_tokens_of(i: int) -> int:
    return 2 + i % 7


def test_concurrent_streams_complete_with_the_right_tokens(server, async_llm, tiny_chat_model_dir):
    offline = LLM(str(tiny_chat_model_dir), **ENGINE_KWARGS)
    longest = offline.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
    decode = offline.tokenizer.decode

    def expected_text(i: int) -> str:
        return decode(longest[i % len(PROMPTS)].outputs[0].token_ids[:max_tokens_of(i)], skip_special_tokens=True)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, object, str]:
        stream = await client.completions.create(model=MODEL_NAME, prompt=PROMPTS[i % len(PROMPTS)],
                                                 max_tokens=max_tokens_of(i), temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return "".join(text), usage, finish

    async def main():
        queue = asyncio.Queue()
        for i in range(NUM_REQUESTS):
            queue.put_nowait(i)
        results = {}
        async with openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120) as client:
            async def worker():
                while not queue.empty():
                    i = queue.get_nowait()
                    results[i] = await one(client, i)

            await asyncio.gather(*(worker() for _ in range(NUM_CLIENTS)))
        return results

    results = asyncio.run(main())
    assert sorted(results) == list(range(NUM_REQUESTS))
    for i, (text, usage, finish) in results.items():
        assert usage.completion_tokens == max_tokens_of(i) and finish == "length", i
        assert text == expected_text(i), i
    wait_for_empty_engine(async_llm)


def test_disconnected_streams_are_aborted_and_free_their_blocks(server, async_llm):
    body = dict(model=MODEL_NAME, max_tokens=480, temperature=0, stream=True, ignore_eos=True)
    with finish_reasons(async_llm) as ended, httpx.Client(timeout=60) as client:
        responses = []
        for prompt in PROMPTS:
            request = client.build_request("POST", f"{server.url}/completions", json=dict(body, prompt=prompt))
            responses.append(client.send(request, stream=True))
        # Keep each line iterator referenced: a dropped one closes its connection (a disconnect of its own).
        lines = [response.iter_lines() for response in responses]
        for stream in lines:  # every stream has started: its request holds blocks
            assert next(line for line in stream if line).startswith("data: {")
        assert async_llm.num_running + async_llm.num_waiting == len(PROMPTS) and not kv_pool_free(async_llm)
        assert not ended
        for response in responses:
            response.close()
        wait_for_empty_engine(async_llm, timeout=20)
    assert list(ended.values()) == ["abort"] * len(PROMPTS)


def test_a_client_that_gives_up_on_a_whole_response_is_aborted(server, async_llm):
    body = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=480, ignore_eos=True)
    with finish_reasons(async_llm) as ended:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
        wait_for_empty_engine(async_llm, timeout=20)
    assert list(ended.values()) == ["abort"]


def stream_in_thread(url: str, max_tokens: int, results: list, model: str = MODEL_NAME,
                     first_chunk: threading.Event | None = None) -> threading.Thread:
    """A streaming request on a thread; ``results`` gets its completion token count, or the error it ended with.
    ``thread.first_chunk`` is set when the first chunk arrives."""
    def run():
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        try:
            chunks = []
            for chunk in client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=max_tokens, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}):
                chunks.append(chunk)
                thread.first_chunk.set()
            results.append(chunks[-1].usage.completion_tokens)
        except (openai.APIError, httpx.HTTPError) as error:
            results.append(error)

    thread = threading.Thread(target=run)
    thread.first_chunk = first_chunk or threading.Event()
    thread.start()
    return thread


def test_stopping_the_server_lets_requests_in_flight_finish(make_async_llm):
    llm = make_async_llm()
    server = ServerThread(llm, served_model_name=MODEL_NAME)
    results = []
    threads = [stream_in_thread(server.url, 40, results) for _ in range(4)]
    wait_until(lambda: llm.num_running == 4)
    server.stop(timeout=60)
    for thread in threads:
        thread.join(60)
    assert results == [40] * 4
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/models")
    llm.shutdown(timeout=0)
    assert kv_pool_free(llm)


def test_a_shutdown_timeout_aborts_what_is_left(make_async_llm):
    llm = make_async_llm()
    server = ServerThread(llm, served_model_name=MODEL_NAME, shutdown_timeout=0.5)
    results = []
    threads = [stream_in_thread(server.url, 480, results) for _ in range(3)]
    wait_until(lambda: llm.num_running == 3)
    server.stop(timeout=60)
    for thread in threads:
        thread.join(60)
    assert len(results) == 3 and not any(r == 480 for r in results)  # cut short: an error or fewer tokens
    wait_for_empty_engine(llm, timeout=20)
    llm.shutdown(timeout=0)


def test_minillm_serve_stops_gracefully_on_sigterm(tiny_chat_model_dir):
    command = [sys.executable, "-m", "minillm.cli", "serve", str(tiny_chat_model_dir), "--port", "0",
               "--dtype", "float32", "--device", "cpu", "--uvicorn-log-level", "warning"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            line = process.stdout.readline()
            url = re.search(r"http://\S+/v1", line)
            assert url, line + process.stderr.read()
            url = url.group(0)
            assert [m["id"] for m in httpx.get(f"{url}/models").json()["data"]] == [str(tiny_chat_model_dir)]
            results = []
            client = stream_in_thread(url, 400, results, model=str(tiny_chat_model_dir), first_chunk=threading.Event())
            assert client.first_chunk.wait(60)
            process.send_signal(signal.SIGTERM)
            client.join(60)
            assert process.wait(60) == 0, process.stderr.read()
        finally:
            process.kill()
    assert results == [400]
