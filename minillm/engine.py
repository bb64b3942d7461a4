"""Engine: the loop. ``add_request`` queues work, ``step`` runs one model forward, ``abort`` cancels.

A step is three moves, as in nano-vllm: the scheduler picks the batch (and how many tokens each
request computes), the runner runs the model and samples a token wherever a sequence's context is
complete, and ``_postprocess`` appends the tokens, detokenizes, and checks stop conditions. A pure
decode batch may run several passes in one step, or have the next batch chained to it (``num_scheduler_steps``,
``async_scheduling``: ``minillm/multi_step.py``'s scheduler and runner, which the engine then picks): their tokens
are postprocessed pass by pass, as if each had been a step. With
preemption_mode="swap", the KV copies the scheduler decided (``batch.swaps``) run first, through
``KVSwapper``. Everything else (which requests, which tensors) lives in the scheduler and the runner.
A request with ``n`` > 1 is a ``SequenceGroup`` of n sequences (``minillm/sequence_group.py``); the
log-probabilities a request asked for come with the runner's tokens and are recorded as they are appended.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

import torch

from minillm.config import EngineConfig, resolve_device
from minillm.kernels.checks import interpreter_on
from minillm.kv.budget import units_that_fit
from minillm.kv.paged import BlockAllocator, BlockTables, PagedBatch, PagedKVCache
from minillm.kv.quant import kv_bytes_per_token
from minillm.model.loader import load_model, model_bytes, resolve_dtype
from minillm.logprobs import StepLogprobs
from minillm.request import Request, RequestOutput, SamplingParams
from minillm.runner import PagedRunner, StaticRunner
from minillm.scheduler import ContinuousScheduler, ScheduledBatch
from minillm.static_scheduler import DynamicScheduler, StaticScheduler
from minillm.sequence_group import SequenceGroup, SequenceGroups, sequence_id
from minillm.tokenizer import detokenize_step, encode_prompt
from minillm.validation import (InvalidArgument, InvalidArgumentType, check_int, check_text, check_token_ids,
                                describe)

DEFAULT_MAX_MODEL_LEN = 2048


@dataclass
class StepStats:
    """What one step did (vLLM logs the same per iteration)."""

    time: float  # perf_counter at the end of the step
    num_seqs: int  # sequences in the batch
    num_tokens: int  # tokens computed (prefill chunks + decodes)
    kv_usage: float  # fraction of the KV cache in use (paged: blocks held; static: rows reserved)
    num_preemptions: int  # preemptions so far
    num_passes: int = 1  # forward passes: up to num_scheduler_steps for a multi-step decode batch


def resolve_attention_backend(backend: str, device: torch.device) -> str:
    """"auto" -> the Triton kernels on CUDA, the torch reference elsewhere."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not interpreter_on():
        raise ValueError("attention_backend='triton' needs a CUDA device; on a CPU use 'torch', or set "
                         "TRITON_INTERPRET=1 before starting Python to run the kernels in Triton's (slow) interpreter")
    return backend


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.workers = None  # this process's rank (parallel.workers.Workers), with tensor or pipeline parallelism
        size, all_reduce = config.tensor_parallel_size, None
        if size > 1:  # checked before any process starts
            from minillm.parallel import all_reduce
            choice = all_reduce.chosen(config.tp_all_reduce, self.device, size)
        if size > 1 or config.pipeline_parallel_size > 1:
            from minillm.parallel.workers import Workers  # worker processes: only when asked for

            self.workers = Workers.start(config, self.device, type(self))
            self.device = self.workers.device
        self.dtype = resolve_dtype(config.dtype, self.device)
        loaded = load_model(config.model, config.load_format, self.dtype, self.device, config.seed,
                            None if self.workers is None else self.workers.part, config.quantization,
                            config.calibration_samples)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        if all_reduce is not None:  # before any graph captures the all-reduces
            all_reduce.install(choice, self.model, self.workers, config.max_num_seqs,
                               config.max_num_batched_tokens, self.model_config.hidden_size, self.dtype)
        self.model_source, self.quantization = loaded.source, loaded.quantization
        model_limit = self.model_config.max_position_embeddings
        self.max_model_len = config.max_model_len or min(model_limit, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > model_limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={model_limit}")
        window = self.model_config.sliding_window
        if window is not None and self.max_model_len > window:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's sliding window ({window}); "
                             f"minillm has no sliding-window attention, so keep max_model_len <= {window}")
        # Before the caches are sized and the decode graphs captured (the graphs capture its copies).
        self.offloader = None
        if config.cpu_offload_gb:
            from minillm.offload import offload_layers

            self.offloader = offload_layers(self.model, config.cpu_offload_gb, self.device)
        self.offloaded_weight_bytes = 0 if self.offloader is None else self.offloader.offloaded_bytes
        # Weights on the device, what the memory budget charges: parameters and buffers (quantized layers
        # keep their packed weights in buffers), less the offloaded layers, plus their staging buffers.
        self.weight_bytes = model_bytes(self.model) - self.offloaded_weight_bytes
        if self.offloader is not None:
            self.weight_bytes += self.offloader.staging_bytes
        # Scales included with a quantized kv_cache_dtype: this is what the memory budget divides by.
        self.kv_bytes_per_token = kv_bytes_per_token(self.model_config, config.kv_cache_dtype, self.dtype)
        self.attention_backend: str | None = None  # the paged cache's; the contiguous cache has one path
        self.cuda_graphs = False
        self.prefix_cache = None  # kv.radix.RadixCache: continuous, enable_prefix_caching
        self.swapper = None  # kv.swap.KVSwapper, the CPU swap space: continuous, preemption_mode="swap"
        if config.batching in ("static", "dynamic"):
            self._build_static()
        else:
            self._build_paged()
        if self.workers is not None:
            self.workers.connect(self.runner)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.requests: dict[str, Request | SequenceGroup] = {}  # by request id; n > 1: a group of sequences
        self.groups = SequenceGroups()
        self._ids = itertools.count()
        self.stats: deque[StepStats] = deque(maxlen=100_000)  # the most recent steps
        # Async scheduling: the batch launched and not yet read, with its tokens (multi_step.LaunchedSteps).
        self._in_flight = None

    def _build_static(self) -> None:
        per_sequence = self.kv_bytes_per_token * self.max_model_len
        budget = self._memory_budget()
        fit = self.config.max_num_seqs if budget is None else units_that_fit(
            budget, self.weight_bytes, per_sequence, "sequence of max_model_len")
        self.max_batch = min(self.config.max_num_seqs, fit)
        self.kv_capacity_tokens = self.max_batch * self.max_model_len
        if self.config.batching == "dynamic":
            self.scheduler = DynamicScheduler(self.max_batch, self.max_model_len, self.config.batch_timeout,
                                              self.config.bucket_width)
        else:
            self.scheduler = StaticScheduler(self.max_batch, self.max_model_len)
        self.runner = StaticRunner(self.model, self.max_batch, self.max_model_len, self.device, self.config.seed)
        self.kv_cache_bytes = self.runner.cache.nbytes

    def _build_paged(self) -> None:
        c = self.config
        budget = self._memory_budget()
        if c.num_kv_blocks is not None:
            num_blocks = c.num_kv_blocks
        elif budget is not None:
            footprints = [(self.weight_bytes, self.kv_bytes_per_token)]
            if self.stage is not None:  # every rank has as many blocks as the fullest stage can hold
                from minillm.parallel.pp import stage_footprints

                footprints = stage_footprints(self.workers.model_config, self.stage.size, self.dtype)
            num_blocks = min(units_that_fit(budget, weights, kv * c.block_size, "KV block")
                             for weights, kv in footprints)
        else:  # a CPU without a budget: as much KV as the static baseline reserves (8 full sequences)
            num_blocks = -(-8 * self.max_model_len // c.block_size)
        self.max_batch = c.max_num_seqs
        self.kv_capacity_tokens = num_blocks * c.block_size
        self.block_tables = BlockTables(BlockAllocator(num_blocks), c.block_size)
        cache = PagedKVCache(self.model_config, num_blocks, c.block_size, self.dtype, self.device, c.kv_cache_dtype)
        cpu_block_tables = None
        if c.preemption_mode == "swap":  # the scheduler allocates CPU block ids, the swapper owns the tensors
            from minillm.kv.swap import KVSwapper, swap_blocks_that_fit

            num_cpu_blocks = swap_blocks_that_fit(c.swap_space, cache)
            self.swapper = KVSwapper(cache, num_cpu_blocks)
            cpu_block_tables = BlockTables(BlockAllocator(num_cpu_blocks), c.block_size)
        scheduler_class, runner_class, steps = ContinuousScheduler, PagedRunner, {}
        if c.num_scheduler_steps > 1 or c.async_scheduling:  # several passes a step, or chained steps
            from minillm.multi_step import MultiStepRunner, MultiStepScheduler

            scheduler_class, runner_class = MultiStepScheduler, MultiStepRunner
            steps = {"num_scheduler_steps": c.num_scheduler_steps}
        # vLLM's default watermark: keep 1 % of blocks free at admission so decodes can grow.
        self.scheduler = scheduler_class(self.block_tables, c.max_num_seqs, c.max_num_batched_tokens,
                                         c.scheduling_policy, watermark_blocks=num_blocks // 100,
                                         cpu_block_tables=cpu_block_tables, max_model_len=self.max_model_len, **steps)
        if c.enable_prefix_caching:
            from minillm.kv.radix import RadixCache

            self.prefix_cache = RadixCache(self.block_tables.allocator, c.block_size)
            self.scheduler.prefix_cache = self.prefix_cache
            self.block_tables.evict = self.prefix_cache.evict
        self.attention_backend = resolve_attention_backend(c.attention_backend, self.device)
        make_attention = PagedBatch
        if self.attention_backend == "triton":
            from minillm.kv.paged_triton import TritonPagedBatch  # imports triton: only when asked for
            make_attention = TritonPagedBatch
            self.model.enable_fused_kernels()  # the "triton" backend is all of minillm's kernels
        # CUDA graphs need the Triton kernels: the torch reference's shapes follow the context lengths.
        self.cuda_graphs = self.device.type == "cuda" and not c.enforce_eager and self.attention_backend == "triton"
        graphs = None
        if self.cuda_graphs:
            from minillm.cuda_graphs import DecodeGraphs

            graphs = DecodeGraphs(self.model, cache, make_attention, min(c.max_num_seqs, num_blocks),
                                  self.max_model_len, self.device)
            if self.workers is not None:
                self.workers.on_shutdown(graphs.release)
        if self.stage is not None:
            from minillm.parallel.pp import PipelineRunner

            self.runner = PipelineRunner(self.model, cache, self.block_tables, self.device, c.seed, make_attention,
                                         self.workers, c.pipeline_micro_batches)
        else:
            self.runner = runner_class(self.model, cache, self.block_tables, self.device, c.seed, make_attention,
                                       graphs)
        if self.attention_backend == "triton" and self.device.type == "cuda":
            from minillm.kernels.greedy import greedy_argmax
            self.runner.sampler.argmax = greedy_argmax
        self.kv_cache_bytes = cache.nbytes

    def _memory_budget(self) -> int | None:
        if self.config.memory_budget is not None:
            return self.config.memory_budget
        if self.device.type == "cuda":
            return int(torch.cuda.get_device_properties(self.device).total_memory * self.config.gpu_memory_utilization)
        return None  # on a CPU, RAM is the user's to manage

    # -- the public API ---------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None) -> str:
        """Validate and queue one request; returns its id. Bad input raises ValueError here."""
        return self.queue(self.make_request(prompt, params, request_id=request_id, priority=priority,
                                            arrival_time=arrival_time))

    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                     request_id: str | None = None, priority: int = 0, arrival_time: float | None = None) -> Request:
        """Check one request and tokenize it, without queueing it: a caller with several requests checks
        them all before queueing any. Bad input raises ``validation.InvalidArgument`` (a ValueError)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentType("sampling_params", f"sampling_params must be a SamplingParams, "
                                                         f"got {describe(params)}")
        priority = check_int("priority", priority)
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidArgument("priority", f"priority={priority!r} needs scheduling_policy='priority' "
                                              f"(now {self.config.scheduling_policy!r})")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("prompt", "prompt is empty; give at least one character or token id")
            text, token_ids = check_text("prompt", prompt), encode_prompt(self.tokenizer, prompt)
        else:
            text, token_ids = None, check_token_ids("prompt", prompt, self.model_config.vocab_size, "prompt token ids")
        if not token_ids:
            raise InvalidArgument("prompt", "prompt is empty; give at least one token id")
        if len(token_ids) >= self.max_model_len:
            raise InvalidArgument("prompt", f"prompt has {len(token_ids)} tokens, but max_model_len is "
                                            f"{self.max_model_len} (prompt + at least one output token must fit); "
                                            f"shorten it or raise max_model_len")
        if self.config.batching == "continuous":
            total = min(len(token_ids) + params.max_tokens, self.max_model_len)
            if -(-total // self.config.block_size) > self.block_tables.allocator.num_blocks:
                raise InvalidArgument("max_tokens", f"prompt ({len(token_ids)} tokens) + max_tokens "
                                                    f"({params.max_tokens}) needs {total} tokens of KV cache, but it "
                                                    f"holds only {self.kv_capacity_tokens}; lower max_tokens or give "
                                                    f"the cache more memory")
        params.check_engine(self.model_config.vocab_size, self.config.batching)
        request_id = str(next(self._ids)) if request_id is None else request_id
        self._check_id_free(request_id, params.n)
        if params.n == 1:
            return Request(request_id, text, token_ids, params, priority, arrival_time)
        return SequenceGroup(request_id, text, token_ids, params, priority, arrival_time)

    def queue(self, request: Request | SequenceGroup) -> str:
        """Hand a request from ``make_request`` to the scheduler; returns its id. A request with n > 1 queues its
        first sequence: the others fork from it once it has prefilled the prompt."""
        self._check_id_free(request.request_id, request.params.n)
        self.requests[request.request_id] = request
        if isinstance(request, SequenceGroup):
            self.groups.add(request)
        self.scheduler.add(request.first if isinstance(request, SequenceGroup) else request)
        return request.request_id

    def _check_id_free(self, request_id: str, n: int) -> None:
        for seq_id in (sequence_id(request_id, i) for i in range(n)):  # n > 1: the sequences' ids too
            if seq_id in self.requests or seq_id in self.groups:
                raise InvalidArgument("request_id", f"request id {seq_id!r} is already in use")

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step: one forward pass, or up to ``num_scheduler_steps`` decode passes;
        return the requests that got a token (cumulative outputs, one per request).

        With async scheduling a pure decode batch is launched, then the batch that continues it
        (``MultiStepScheduler.chain``), and only then are the first one's tokens read: the GPU runs the
        second while the host postprocesses the first. The second stays in flight (``_in_flight``) and
        the next step chains a third to it before reading it, until the scheduler must decide again
        (an arrival, a request that ended or ran out of budget, blocks short)."""
        if self._in_flight is not None:
            return self._finish_in_flight()
        batch = self.scheduler.schedule(time.perf_counter())
        if batch is None:
            return []
        if batch.swaps:  # swapped-out blocks leave and swapped-in ones land before the forward pass
            self.swapper.run(batch.swaps)
        if not batch.requests:
            return []
        if self.config.async_scheduling and batch.is_pure_decode:
            self._in_flight = (batch, self.runner.launch_steps(batch))
            return self._finish_in_flight()
        if batch.num_steps > 1:
            outputs = self._postprocess_passes(batch, self.runner.run_steps(batch))
        else:
            outputs = self._postprocess(batch, *self.runner.run(batch))
        self._record_step(batch)
        return outputs

    def _finish_in_flight(self) -> list[RequestOutput]:
        """Chain the next batch to the one in flight (if the scheduler need not decide), then read and
        postprocess the one in flight; the chained one is in flight after."""
        batch, launched = self._in_flight
        chained = self.scheduler.chain(batch)
        self._in_flight = None if chained is None else (chained, self.runner.launch_steps(chained, launched.tokens[-1]))
        outputs = self._postprocess_passes(batch, launched.read())
        self._record_step(batch)
        if chained is not None and all(r.finished for r in chained.requests):
            self._in_flight = None  # every token it computes would be dropped: let it run, unread
        return outputs

    def _record_step(self, batch: ScheduledBatch) -> None:
        self.stats.append(StepStats(time.perf_counter(), len(batch.requests),
                                    sum(batch.num_new_tokens) * batch.num_steps,
                                    self._kv_usage(), getattr(self.scheduler, "num_preemptions", 0), batch.num_steps))

    def _kv_usage(self) -> float:
        if self.config.batching != "continuous":  # every row of a contiguous cache reserves a full sequence
            return len(self.scheduler.running) / self.max_batch
        allocator = self.block_tables.allocator
        return 1 - allocator.num_free / allocator.num_blocks

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request and free its KV (a static batch's row idles until the batch ends)."""
        request = self.requests.pop(request_id, None)
        if request is None or request.finished:
            return None
        sequences = request.sequences if isinstance(request, SequenceGroup) else [request]
        self.groups.forget(sequences)
        for sequence in sequences:
            if not sequence.finished:
                self.scheduler.remove(sequence.request_id)
                sequence.finish("abort")
        return request.to_output()

    @property
    def stage(self):
        """This process's pipeline stage (a ``parallel.pp.Stage``: pipeline_parallel_size > 1), else None."""
        if self.workers is None:
            return None
        from minillm.parallel.pp import Stage

        return self.workers.part if isinstance(self.workers.part, Stage) else None

    def close(self) -> None:
        """Stop the worker processes of a parallel engine (nothing to do in one process)."""
        if self.workers is not None:
            self.workers.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- after the forward pass -------------------------------------------------------------------

    def _postprocess(self, batch: ScheduledBatch, token_ids: list[int | None],
                     logprobs: StepLogprobs | None = None) -> list[RequestOutput]:
        now = time.perf_counter()
        outputs = {}  # by request id: the n sequences of one request give one output
        for index, (request, num_new, token) in enumerate(zip(batch.requests, batch.num_new_tokens, token_ids)):
            if request.finished:
                continue  # a finished row of a static batch: computed, ignored
            request.num_computed_tokens += num_new
            if logprobs is not None:
                logprobs.record(index, request, self.tokenizer)
            if token is None:
                continue  # a prefill chunk that did not reach the end of the prompt yet
            request.output_token_ids.append(token)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.token_times.append(now)
            for forked in self.groups.after_token(request):  # n > 1: the prompt is computed
                self.scheduler.add(forked)
            delta = detokenize_step(self.tokenizer, request)
            self._check_stop(request, token, len(request.text) - len(delta), now)
            if request.finished and not isinstance(request.stop_reason, str):
                detokenize_step(self.tokenizer, request, final=True)  # keep a trailing partial character
            if request.finished:
                self.scheduler.finish(request)
            output = self.groups.output(request) or request.to_output()
            if output.finished:
                self.requests.pop(output.request_id, None)
            outputs[output.request_id] = output
        return list(outputs.values())

    def _postprocess_passes(self, batch: ScheduledBatch, passes: list[list[int]]) -> list[RequestOutput]:
        """A multi-step batch's tokens, pass by pass. ``_postprocess`` skips finished requests, so a
        request's tokens after its stop are dropped; each request reports its latest output."""
        latest = {}
        for token_ids in passes:
            latest.update((o.request_id, o) for o in self._postprocess(batch, token_ids))
        return list(latest.values())

    def _check_stop(self, request: Request, token: int, old_text_len: int, now: float) -> None:
        params = request.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return request.finish("stop", None, now)
        if token in params.stop_token_ids:
            return request.finish("stop", token, now)
        for stop in params.stop:
            # A new match must end inside the new characters, so start just before them.
            at = request.text.find(stop, max(0, old_text_len - len(stop) + 1))
            if at != -1:
                request.text = request.text[:at]
                return request.finish("stop", stop, now)
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            request.finish("length", None, now)
