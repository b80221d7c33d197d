"""Prometheus metrics of one server, in their own registry (so tests can run several servers in one process).

Request-level figures (status codes, time to first token, time per output token, token counts) are
recorded by the HTTP handlers; engine-level gauges (running/waiting requests, KV-cache use, prefix-cache
hit rate, fragmentation) are refreshed by the engine thread a few times a second, token counts and, when
distributed, the time in each kind of collective after every step; the weights version by the reload handler.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics,
                               generate_latest)

if TYPE_CHECKING:
    from unified.engine.outputs import EngineStats

disable_created_metrics()  # the `*_created` timestamp series only add noise to every scrape
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("unified_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.running = Gauge("unified_num_requests_running", "Requests with sequences in the running batch", registry=r)
        self.waiting = Gauge("unified_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.ttft = Histogram("unified_time_to_first_token_seconds", "Time from arrival to the first output token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("unified_time_per_output_token_seconds", "Time between output tokens of a request",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("unified_request_latency_seconds", "Time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("unified_requests_finished", "Generation requests ended, by reason (stop, length, "
                                "abort: the client went away or shutdown cancelled it)", ["reason"], registry=r)
        self.prompt_tokens = Counter("unified_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("unified_generation_tokens", "Tokens generated", registry=r)
        self.kv_usage = Gauge("unified_kv_cache_usage_ratio", "KV-cache blocks in use over all blocks", registry=r)
        self.kv_used_blocks = Gauge("unified_kv_cache_used_blocks", "KV-cache blocks held by sequences", registry=r)
        self.kv_total_blocks = Gauge("unified_kv_cache_total_blocks", "KV-cache blocks in all", registry=r)
        self.fragmentation = Gauge("unified_kv_cache_fragmentation_ratio",
                                   "Allocated but unfilled KV slots over allocated slots", registry=r)
        self.prefix_hit_rate = Gauge("unified_prefix_cache_hit_rate",
                                     "Prompt tokens found in the prefix cache over tokens looked up", registry=r)
        # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens
        self.prefix_queries = Counter("unified_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("unified_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self._prefix_seen = (0, 0)  # the engine's (queried, hit) tokens at the last refresh
        # vLLM's spec_decode_* counters (engine.speculative on): steps with a draft, draft tokens, accepted ones
        self.spec_drafts = Counter("unified_spec_decode_num_drafts", "Sequence steps that verified a draft",
                                   registry=r)
        self.spec_draft_tokens = Counter("unified_spec_decode_num_draft_tokens", "Draft tokens proposed",
                                         registry=r)
        self.spec_accepted_tokens = Counter("unified_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            registry=r)
        self.spec_accepted_per_pos = Counter("unified_spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by their position in the draft", ["position"],
                                             registry=r)
        self._spec_seen: tuple[int, int, int, list[int]] = (0, 0, 0, [])
        self.preemptions = Gauge("unified_num_preemptions", "Sequences preempted for lack of KV blocks", registry=r)
        self.collective_seconds = Histogram("unified_collective_seconds",
                                            "Time per engine step in each kind of collective (distributed only)",
                                            ["kind"], buckets=_LATENCY_BUCKETS, registry=r)
        self.weights_version = Gauge("unified_weights_version", "Times the served weights were replaced since "
                                     "start (POST /v1/admin/reload_weights); 0: the weights it started with",
                                     registry=r)
        self.weight_updates = Counter("unified_weight_updates", "Weight updates applied (reloads and trainers' "
                                      "updates from disk or over torch.distributed)", registry=r)
        self.weight_update_bytes = Counter("unified_weight_update_bytes", "Bytes of weights received or read by "
                                           "those updates", registry=r)
        self.weight_update_seconds = Counter("unified_weight_update_seconds", "Time spent applying those updates",
                                             registry=r)
        self.weight_version = Info("unified_weight_version", "The served policy's weight_version (recipe=rollout)",
                                   registry=r)
        self.asleep_seconds = Counter("unified_asleep_seconds", "Time spent asleep (POST /sleep to /wake_up)",
                                      registry=r)
        self.step_seconds = Histogram("unified_engine_step_seconds", "Duration of one engine step",
                                      buckets=_LATENCY_BUCKETS, registry=r)

    def engine_step(self, stats: EngineStats | None, new_tokens: int, seconds: float,
                    collectives: dict[str, float]) -> None:
        if stats is not None:
            self._engine_gauges(stats)
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
            self.step_seconds.observe(seconds)
        for kind, spent in collectives.items():
            self.collective_seconds.labels(kind).observe(spent)

    def _engine_gauges(self, stats: EngineStats) -> None:
        self.running.set(stats.running_requests)
        self.waiting.set(stats.waiting_requests)
        self.kv_usage.set(stats.kv_usage)
        self.kv_used_blocks.set(stats.used_blocks)
        self.kv_total_blocks.set(stats.total_blocks)
        self.fragmentation.set(stats.fragmentation)
        self.prefix_hit_rate.set(stats.prefix_hit_rate)
        now = (stats.prefix_queried_tokens, stats.prefix_hit_tokens)
        if now[0] < self._prefix_seen[0]:  # the engine reset its prefix cache (a weight swap): count afresh
            self._prefix_seen = (0, 0)
        self.prefix_queries.inc(now[0] - self._prefix_seen[0])
        self.prefix_hits.inc(now[1] - self._prefix_seen[1])
        self._prefix_seen = now
        self.preemptions.set(stats.preemptions)
        if stats.spec is not None:
            self._spec_counters(stats.spec)

    def _spec_counters(self, spec) -> None:
        drafts, draft_tokens, accepted, per_pos = self._spec_seen
        self.spec_drafts.inc(spec.num_drafts - drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens - draft_tokens)
        self.spec_accepted_tokens.inc(spec.num_accepted_tokens - accepted)
        for position, count in enumerate(spec.accepted_per_pos):
            seen = per_pos[position] if position < len(per_pos) else 0
            self.spec_accepted_per_pos.labels(str(position)).inc(count - seen)
        self._spec_seen = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                           list(spec.accepted_per_pos))

    def weight_updated(self, nbytes: int, seconds: float, version: int) -> None:
        self.weight_updates.inc()
        self.weight_update_bytes.inc(nbytes)
        self.weight_update_seconds.inc(seconds)
        self.weights_version.set(version)

    def render(self) -> bytes:
        return generate_latest(self.registry)
