"""The engine of a simulated rank: vLLM v1's continuous-batching scheduler over a :class:`BlockPool`.

Each step, like vLLM's ``Scheduler.schedule`` (FCFS policy):
1. running requests first, in admission order, each asking for its remaining tokens (a prefill
   chunk, or 1 decode token) within the step's token budget (``max_num_batched_tokens``); when the
   pool cannot give a request its blocks, the NEWEST running request is preempted (its blocks freed
   tail first, ``num_computed_tokens = 0``, back at the head of the waiting queue) until it can, or
   until the request preempted itself;
2. then, unless something was preempted this step, waiting requests in order while the budget and
   ``max_num_seqs`` allow: a request with nothing computed looks up its leading cached blocks
   (at most ``(num_tokens - 1) // block_size`` blocks: the last token is always recomputed), touches
   them and gets new blocks for the rest of its chunk; the head of the queue blocks those behind it.
Full blocks are hashed and cached as soon as they are allocated for tokens known to the request
(prompt, or generated tokens: decode blocks are cached as they fill). The step then lasts the
modelled time (``bench/sim/config.py``), after which every request that has computed all its tokens
samples one token; a request with ``max_tokens`` tokens finishes and frees its blocks tail first.

With a CPU tier (``bench/sim/cpu_tier.py``), the lookup goes on in the tier after the GPU hits: those
blocks get new GPU blocks like a prefill, but cost ``cpu_load_rate`` time instead of prefill time
(``StepPlan.loaded_tokens``), and count in ``cached_tokens`` as vLLM counts its connector's hits
(``num_cached_tokens`` is the local plus the external computed tokens); ``prefix_cache_hits`` stays
the GPU hits (vLLM's local prefix-cache metric) and ``cpu_tier_hits`` counts the others.

Prefix-cache counters follow vLLM's ``PrefixCacheStats``: a lookup by a request never preempted
counts in ``queries``/``hits`` (what ``vllm:prefix_cache_*_total`` export), a lookup after a preemption
in ``preempted_queries``/``preempted_hits``. Unlike vLLM, a lookup counts only when the request is
actually admitted (vLLM also counts lookups whose allocation fails and are retried next step), so the
hit counters (GPU and CPU tier) always add up to the sum of the ``cached_tokens`` reported to clients.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.sim.block_pool import Block, BlockPool, PoolEvent
from bench.sim.config import SimConfig
from bench.sim.cpu_tier import CpuTier, passed_over_cpu_blocks
from bench.sim.latency import RequestLatencies
from bench.sim.prompts import Prompt
from bench.sim.sequences import OUTPUT_TOKEN_IDS, OutQueue, RequestTooLarge, SimRequest, Status
from tokenization.block_hash import BlockHasher


@dataclass(slots=True)
class StepPlan:
    """What one step computes: (request, tokens) pairs and the figures of the timing model."""

    scheduled: list[tuple[SimRequest, int]]
    prefill_tokens: int = 0
    #: Prompt tokens loaded back from the CPU tier instead of prefilled.
    loaded_tokens: int = 0
    decode_seqs: int = 0
    decode_context_tokens: int = 0


@dataclass
class Counters:
    """Monotonic engine counters (``/metrics``, ``/sim/state``)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    #: Tokens of admitted prompts loaded from the CPU tier (reported in ``cached_tokens`` too).
    cpu_tier_hits: int = 0
    #: Modelled (unscaled) seconds spent loading them.
    cpu_load_s: float = 0.0
    #: Prompts admitted here while another rank of the fleet held more of them, part of that in its
    #: CPU tier: turns moved off the rank keeping their session's blocks in CPU memory.
    passed_over_cpu_tier: int = 0
    num_preemptions: int = 0
    requests_finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


class Engine:
    """Pool, queues, scheduler and step loop of one rank. Runs on one asyncio loop; not thread-safe."""

    def __init__(
        self, config: SimConfig, on_events: Callable[[float, list[PoolEvent]], None] | None = None
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        blocks = config.cpu_tier_blocks
        self.cpu_tier = CpuTier(blocks) if blocks > 0 else None
        #: The other ranks of this process's fleet (``runner.start_fleet``): read to count prompts
        #: sent away from a rank holding their blocks in its CPU tier (``passed_over_cpu_tier``).
        self.peers: list[Engine] = []
        self.pool = BlockPool(
            config.total_blocks,
            config.block_size,
            record_events=on_events is not None,
            cpu_tier=self.cpu_tier,
        )
        self.hasher = BlockHasher(config.block_size, config.hash_algo, config.none_hash_seed)
        self.on_events = on_events
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.counters = Counters()
        self.latencies = RequestLatencies()
        self._wakeup = asyncio.Event()
        self._stopping = False

    # -- requests ------------------------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        max_tokens: int,
        n: int = 1,
        *,
        cache_salt: str | None = None,
        skip_prefix_cache: bool = False,
        script: tuple[int, ...] | None = None,
    ) -> tuple[list[SimRequest], OutQueue]:
        """Queue a request as ``n`` sequences; each sampled token arrives on the returned queue as
        ``(index, token_id, finish_reason)``, ``finish_reason`` set on a sequence's last token.
        ``script``: the tokens each sequence generates, then stops (instead of ``max_tokens`` words)."""
        if script is not None:
            max_tokens = max(len(script), 1)
        num_prompt = len(prompt.token_ids)
        if num_prompt == 0:
            raise RequestTooLarge("the prompt is empty")
        if num_prompt + max_tokens > self.config.max_model_len:
            raise RequestTooLarge(
                f"This model's maximum context length is {self.config.max_model_len} tokens. However, you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in "
                "the completion). Please reduce the length of the messages or completion."
            )
        needed = -(-(num_prompt + max_tokens) // self.block_size)
        if needed > self.pool.usable_blocks:
            raise RequestTooLarge(
                f"the request needs {needed} KV blocks, the pool has {self.pool.usable_blocks}"
            )
        out: OutQueue = asyncio.Queue()
        now = time.monotonic()
        reqs = [
            SimRequest(
                index=i,
                # Each sequence appends its own output: own copies of the token and hash lists.
                all_token_ids=list(prompt.token_ids),
                block_hashes=list(prompt.block_hashes),
                num_prompt_tokens=num_prompt,
                max_tokens=max_tokens,
                out=out,
                cache_salt=cache_salt,
                skip_prefix_cache=skip_prefix_cache,
                script=script or None,
                arrival=now,
            )
            for i in range(n)
        ]
        self.waiting.extend(reqs)
        self._wakeup.set()
        return reqs, out

    def abort(self, reqs: list[SimRequest]) -> None:
        """Drop unfinished sequences (client gone): out of the queues, blocks freed."""
        for req in reqs:
            if req.status in (Status.FINISHED, Status.ABORTED):
                continue
            if req.status is Status.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._free(req)
            req.status = Status.ABORTED
        self._flush_events()

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: refused while requests hold blocks."""
        ok = self.pool.reset_prefix_cache()
        self._flush_events()
        return ok

    # -- KV cache manager ----------------------------------------------------------------------
    def _computed_blocks(self, req: SimRequest) -> list[Block]:
        if req.skip_prefix_cache:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        get = self.pool.get_cached
        hits: list[Block] = []
        for h in itertools.islice(req.block_hashes, max_blocks):  # no copy of a 6,000-hash list
            block = get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _count_passed_over(self, req: SimRequest, held: int) -> None:
        """Count ``req`` when a peer rank held more of its prompt, part in its CPU tier."""
        max_blocks = min(len(req.block_hashes), (req.num_tokens - 1) // self.block_size)
        peers = [(p.pool.cached, p.cpu_tier) for p in self.peers if p is not self and p.cpu_tier is not None]
        if passed_over_cpu_blocks(req.block_hashes, max_blocks, held, peers):
            self.counters.passed_over_cpu_tier += 1

    def _cpu_hits(self, req: SimRequest, gpu_hits: int) -> int:
        """Blocks the CPU tier holds right after the ``gpu_hits`` leading GPU hits (a read)."""
        tier = self.cpu_tier
        if tier is None or req.skip_prefix_cache:
            return 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        return tier.hits(itertools.islice(req.block_hashes, gpu_hits, max_blocks))

    def _allocate(
        self, req: SimRequest, num_new_tokens: int, computed: list[Block] | None = None, loaded: int = 0
    ) -> bool:
        """Blocks for ``num_new_tokens`` after the GPU hits ``computed`` and ``loaded`` blocks
        loaded from the CPU tier (which take new blocks, as prefilled ones do)."""
        size = self.block_size
        pool = self.pool
        num_hit = len(computed) if computed else 0
        num_computed = req.num_computed_tokens + (num_hit + loaded) * size
        total = num_computed + num_new_tokens
        num_new_blocks = -(-total // size) - len(req.blocks) - num_hit
        # Hit blocks sitting in the free queue stop being allocatable once touched.
        evictable_hits = sum(1 for b in computed if b.ref_cnt == 0) if computed else 0
        if num_new_blocks > pool.num_free - evictable_hits:
            return False
        if computed:
            pool.touch(computed)
            req.blocks.extend(computed)
            req.num_cached_blocks = len(req.blocks)
        if loaded:
            # before new blocks are taken: the evictions they cause offload to the tier, whose own
            # evictions must not take the blocks being loaded
            assert self.cpu_tier is not None
            start = req.num_computed_tokens // size + num_hit
            self.cpu_tier.load(req.block_hashes[start : start + loaded])
        if num_new_blocks > 0:
            req.blocks.extend(pool.get_new_blocks(num_new_blocks))
        num_full = min(total, req.num_tokens) // size
        if num_full > req.num_cached_blocks:
            pool.cache_full_blocks(
                req.blocks, req.block_hashes, req.num_cached_blocks, num_full, req.all_token_ids
            )
            req.num_cached_blocks = num_full
        return True

    def _free(self, req: SimRequest) -> None:
        # Tail first: the end of a chain is evicted before its beginning.
        self.pool.free_blocks(reversed(req.blocks))
        req.blocks = []
        req.num_cached_blocks = 0

    def _preempt(self, req: SimRequest) -> None:
        self._free(req)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Choose this step's work and allocate its blocks (see the module docstring)."""
        budget = self.config.max_num_batched_tokens
        plan = StepPlan([])
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            scheduled = True
            while not self._allocate(req, num_new):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            self._add(plan, req, num_new)
            budget -= num_new
            i += 1

        if not preempted:
            waiting = self.waiting
            max_seqs = self.config.max_num_seqs
            while waiting and budget > 0 and len(running) < max_seqs:
                req = waiting[0]
                fresh = req.num_computed_tokens == 0
                hits = self._computed_blocks(req) if fresh else []
                loaded = self._cpu_hits(req, len(hits)) if fresh else 0
                num_gpu_hit_tokens = len(hits) * self.block_size
                num_hit_tokens = num_gpu_hit_tokens + loaded * self.block_size
                num_new = min(req.num_tokens - req.num_computed_tokens - num_hit_tokens, budget)
                if not self._allocate(req, num_new, hits, loaded):
                    break
                waiting.popleft()
                if loaded:
                    plan.loaded_tokens += loaded * self.block_size
                    if not req.num_preemptions:
                        self.counters.cpu_tier_hits += loaded * self.block_size
                if fresh and self.peers and not req.num_preemptions:
                    self._count_passed_over(req, len(hits) + loaded)
                if not req.skip_prefix_cache:
                    self._record_lookup(req, num_gpu_hit_tokens)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit_tokens
                    req.scheduled_at = time.monotonic()
                req.num_computed_tokens += num_hit_tokens
                req.status = Status.RUNNING
                running.append(req)
                self._add(plan, req, num_new)
                budget -= num_new
        return plan

    def _record_lookup(self, req: SimRequest, hit_tokens: int) -> None:
        c = self.counters
        if req.num_preemptions:
            c.preempted_queries += req.num_tokens
            c.preempted_hits += hit_tokens
        else:
            c.prefix_cache_queries += req.num_tokens
            c.prefix_cache_hits += hit_tokens

    @staticmethod
    def _add(plan: StepPlan, req: SimRequest, num_new: int) -> None:
        plan.scheduled.append((req, num_new))
        if num_new == 1 and req.output_token_ids and req.num_computed_tokens == req.num_tokens - 1:
            plan.decode_seqs += 1
            plan.decode_context_tokens += req.num_computed_tokens
        else:
            plan.prefill_tokens += num_new

    def step_time(self, plan: StepPlan) -> float:
        """Modelled duration of a step in unscaled seconds."""
        cfg = self.config
        t = plan.prefill_tokens / cfg.prefill_rate + self.load_time(plan)
        if plan.decode_seqs:
            t += (
                cfg.decode_base_s
                + cfg.decode_per_seq_s * plan.decode_seqs
                + cfg.decode_per_context_token_s * plan.decode_context_tokens
            )
        return t

    def load_time(self, plan: StepPlan) -> float:
        """Modelled (unscaled) seconds the step spends loading CPU-tier blocks back."""
        rate = self.config.cpu_load_rate
        return plan.loaded_tokens / rate if plan.loaded_tokens and rate > 0 else 0.0

    def update(self, plan: StepPlan) -> None:
        """Apply a finished step: advance computed tokens, sample, finish."""
        size = self.block_size
        hasher = self.hasher
        words = OUTPUT_TOKEN_IDS
        finished: list[SimRequest] = []
        now = time.monotonic()
        for req, num_new in plan.scheduled:
            if req.status is not Status.RUNNING:
                continue  # aborted or preempted during the step
            req.num_computed_tokens += num_new
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk: nothing sampled yet
            k = len(req.output_token_ids)
            if k == 0 and req.index == 0:  # like vLLM: a request's prompt counts once its prefill is done
                self.counters.prompt_tokens += req.num_prompt_tokens
                self.latencies.first_token(req.arrival, req.scheduled_at, now)
            script = req.script
            token = script[k] if script is not None else words[(req.num_prompt_tokens + k) % len(words)]
            req.output_token_ids.append(token)
            req.all_token_ids.append(token)
            self.counters.generation_tokens += 1
            n_tok = len(req.all_token_ids)
            if n_tok % size == 0:
                # A newly full block of generated tokens: hash it now, it is cached when allocated.
                nb = len(req.block_hashes)
                parent = req.block_hashes[-1] if nb else None
                req.block_hashes.extend(
                    hasher.hash_blocks(
                        req.all_token_ids, start_block=nb, parent=parent, cache_salt=req.cache_salt
                    )
                )
            if script is not None and k + 1 >= len(script):
                req.finish_reason = "stop"
                finished.append(req)
            elif k + 1 >= req.max_tokens or n_tok >= self.config.max_model_len:
                req.finish_reason = "length"
                finished.append(req)
            req.out.put_nowait((req.index, token, req.finish_reason))
        for req in finished:
            self.running.remove(req)
            self._free(req)
            self.latencies.finished(req.arrival, now)
            req.status = Status.FINISHED
            self.counters.requests_finished += 1

    # -- loop ----------------------------------------------------------------------------------
    def _flush_events(self) -> None:
        if self.on_events is not None:
            events = self.pool.take_events()
            if events:
                self.on_events(time.time(), events)

    async def run(self) -> None:
        """The step loop; returns after :meth:`stop`."""
        loop = asyncio.get_running_loop()
        scale = self.config.time_scale
        while not self._stopping:
            if not self.running and not self.waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            t0 = loop.time()
            plan = self.schedule()
            self._flush_events()
            if not plan.scheduled:
                # Only when the head of the queue cannot be admitted with nothing running: wait for news.
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            dt = self.step_time(plan)
            self.counters.cpu_load_s += self.load_time(plan)
            delay = t0 + dt * scale - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            self.update(plan)
            self._flush_events()

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()

    def state(self) -> dict[str, Any]:
        """Pool occupancy, queues and counters, for ``GET /sim/state``."""
        pool = self.pool
        return {
            "num_blocks": pool.num_blocks,
            "block_size": self.block_size,
            "free_blocks": pool.num_free,
            "cached_blocks": pool.num_cached_blocks(),
            "kv_cache_usage": pool.usage(),
            "evictions": pool.num_evictions,
            "cpu_tier": None
            if self.cpu_tier is None
            else {
                "capacity_blocks": self.cpu_tier.capacity,
                "cached_blocks": len(self.cpu_tier),
                "stored": self.cpu_tier.stored,
                "evicted": self.cpu_tier.evicted,
                "loaded": self.cpu_tier.loaded,
            },
            "running": len(self.running),
            "waiting": len(self.waiting),
            "counters": dict(vars(self.counters)),
        }
