"""Typed schemas for every run. Hydra validates the composed config against them at start-up, so a
wrong key or type fails with a message naming it.

Top-level plain values (`model=`, `data=`, `input=`, `output=`, `prompt=`, `host=`, `port=`,
`steps=`) are the command-line contract shared by all recipes; component groups (`device`,
`parallel`, ...) are named so they never collide with them. Secrets are never fields here: code that
needs one reads it from the environment variable a field names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING


@dataclass
class DeviceConfig:
    name: str = "auto"  # auto | cpu | cuda | musa
    dtype: str = "auto"  # auto (fp32 on cpu, bf16 on accelerators) | float32 | bfloat16 | float16


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1


@dataclass
class KernelsConfig:
    # auto | reference | triton | cpu: which implementation runs each op (unified/kernels/registry.py);
    # UNIFIED_CPU_KERNELS=0 instead keeps the C++ kernels from being built at all
    backend: str = "auto"


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's speculative_config; unified/engine/speculative.py)."""
    method: Optional[str] = None  # None: off | ngram (prompt lookup) | draft (a smaller model) | mtp (the checkpoint's MTP layer)
    num_tokens: int = 4  # draft tokens proposed per sequence and step
    prompt_lookup_min: int = 2  # ngram: the shortest suffix looked up in the sequence's earlier tokens
    prompt_lookup_max: int = 4  # ngram: the longest, tried first
    draft_model: Optional[str] = None  # draft: the draft model's checkpoint folder (same tokenizer)


@dataclass
class EngineConfig:
    block_size: int = 16  # tokens per KV-cache block
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens in one step (prefill chunks + decodes)
    chunked_prefill: bool = True
    packed_weights: bool = True  # CPU float32: keep oneDNN-packed weight copies (faster matmuls, 2x weight memory)
    prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto (model dtype) | int8 | int4
    kv_cache_bytes: Optional[int] = None  # explicit budget; None: a fraction of free memory
    kv_cache_memory_fraction: float = 0.5  # of the memory free after weights and a warm-up pass
    num_blocks: Optional[int] = None  # fixes the cache size in blocks, overriding both budgets
    max_model_len: Optional[int] = None  # None: the model's context length
    lora_adapter: Optional[str] = None  # a LoRA adapter folder (ours or peft's) served unmerged on the base model
    image_cache_bytes: int = 256 * 2 ** 20  # vision-tower outputs kept by image content hash (LRU)
    # Encode the images of requests about to run while the current step's forward is in flight (on a side
    # stream, overlapping the language model); None: on accelerators, off on CPU, where nothing overlaps.
    image_prefetch: Optional[bool] = None
    # Run every step eagerly: no decode graphs (on accelerators, pure-decode steps otherwise replay CUDA/MUSA
    # graphs captured per padded batch size, unified/engine/decode_graphs.py; on CPU, those of up to 32 sequences
    # replay TorchScript traces, unified/engine/traced_steps.py)
    enforce_eager: bool = False
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # Weights served quantized: None (as loaded) | int8 (weight-only, one scale per output feature) | int4
    # (weight-only, one scale per group of inputs; a symmetric INT4 checkpoint's own groups), made at start from
    # the loaded weights; embeddings, norms, routers and the routed experts stay as loaded
    quantization: Optional[str] = None
    quantize_lm_head: bool = False  # with quantization: the LM head too (kept in full precision by default)
    # With quantize_lm_head: each row's this many best quantized logits are computed again from the full-precision
    # head, which stays loaded (kernels.rescore_top): the top choice is then full precision's wherever it is among
    # them, for a few KiB more read per row; 0: off
    quantized_head_rescore: int = 8
    # With quantization: activation-aware copies (AWQ's per-input scale search; unified/model/calibration.py),
    # calibrated at start on a text: "builtin" (a few hundred tokens that ship with us), a text file of your own
    # domain, or None for plain copies
    quantization_calibration: Optional[str] = "builtin"
    # A pre-sharded model= folder (recipe=convert): check each tensor against the manifest's sha256 as it is read
    verify_checksums: bool = True


@dataclass
class ServeConfig:
    model_name: Optional[str] = None  # the name clients send as `model`; None: the model folder's name
    api_key_env: str = "UNIFIED_API_KEY"  # environment variable holding the bearer token; unset: no auth
    max_body_bytes: int = 1_048_576  # a request body, not counting the data URLs of a chat request's images
    # Images (vision-language models; only data URLs over HTTP, nothing is fetched): at most max_images per
    # chat request across its messages (vLLM's --limit-mm-per-prompt), each data URL at most max_image_bytes
    # (base64: a ~7.5 MB file in 10 MiB). A chat body may so reach max_body_bytes + max_images * max_image_bytes.
    max_images: int = 8
    max_image_bytes: int = 10 * 2 ** 20
    max_tokens: int = 4096  # the largest max_tokens a request may ask for
    default_max_tokens: int = 512  # when a chat request gives none (capped by the context left)
    max_n: int = 8  # samples per prompt (n, and best_of)
    max_prompts: int = 64  # prompts in one completions request (a batch of texts or token-id lists)
    max_messages: int = 256
    warm_up: bool = True  # run representative batch shapes before reporting ready
    retry_after_s: int = 5  # Retry-After sent with 503 while starting
    shutdown_timeout_s: float = 10.0  # in-flight requests get this long after SIGTERM, then are cancelled
    conversation_log: Optional[str] = None  # JSONL file recording each chat completion and feedback on it; None: off
    allow_weight_reload: bool = False  # POST /v1/admin/reload_weights may replace the served weights
    # recipe=rollout: the endpoints RL trainers drive (SGLang's weight sync, vLLM's sleep), off otherwise
    rollout_endpoints: bool = False
    weight_update_timeout_s: float = 120.0  # forming an update group, and each tensor of an update


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    system_prompt: Optional[str] = None


@dataclass
class ParityCheckConfig:
    min_cosine: float = 0.99999
    max_abs_diff: float = 1e-3
    num_tokens: int = 64  # random tokens compared when the model has no tokenizer


@dataclass
class LoraConfig:
    rank: int = 0  # 0: full fine-tuning; > 0: LoRA adapters of this rank, base weights frozen
    alpha: float = 32.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"])  # HF projection names
    experts: bool = False  # also adapt routed experts' projections


@dataclass
class TrainConfig:
    # DeepSpeed ZeRO stage 0 (plain data parallel), 1, 2 or 3; None: 1 on several data-parallel ranks (or with
    # optimizer offload), 0 on one, where partitioning saves nothing and its bookkeeping costs ~40% of a step.
    zero_stage: Optional[int] = None
    offload_optimizer: bool = False  # ZeRO >= 1: optimizer state in CPU memory (DeepSpeed's CPU Adam)
    offload_params: bool = False  # ZeRO-3: parameters in CPU memory
    micro_batch_size: int = 4  # rows per rank per forward
    gradient_accumulation_steps: int = 1
    seq_len: int = 1024  # tokens per row; longer examples are truncated
    packing: bool = True  # several examples per row, attention kept within each example
    epochs: int = 1  # used when `steps` is not set
    lr: float = 2e-5
    min_lr_ratio: float = 0.1  # the schedule ends at lr * min_lr_ratio
    schedule: str = "cosine"  # cosine | linear | constant (all after linear warm-up)
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0: no clipping
    activation_checkpointing: bool = False  # recompute each layer in backward: less memory, ~1/3 more compute
    sequence_parallel: bool = False  # under tensor parallel: norms and residuals hold 1/tp of the sequence
    save_every: int = 0  # steps between checkpoints; 0: only at the end
    keep_checkpoints: int = 2
    resume: bool = True  # continue from the newest checkpoint in `output` if there is one
    shuffle: bool = True
    wandb: str = "offline"  # offline | online | disabled
    wandb_project: str = "unified"
    lora: LoraConfig = field(default_factory=LoraConfig)
    trainable: str = "all"  # all | vision (tower + projector) | projector: the language model frozen in both


@dataclass
class RLHFConfig:
    algorithm: str = "grpo"  # grpo | ppo (set by the recipe's rlhf config group)
    # colocated: every rank rolls out its share of the prompts and trains on it, on the same modules (data
    # parallel over the ranks of a launch); separate: the last `rollout_ranks`
    # ranks (default half the world) roll out on their own copy, synced after each update in buckets, and
    # the others train data-parallel, each on its share of the step's prompt groups
    mode: str = "colocated"
    rollout_ranks: Optional[int] = None
    # separate mode: the layout of each rollout engine (its ranks: tensor x pipeline x expert); the rollout
    # ranks hold as many engines as fit, and the weights are resharded to it at every sync
    rollout_parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sync_bucket_mb: int = 256
    # `reward(prompts, completions, **task_fields) -> list[float]` by import path; the default scores the task
    reward: str = "unified.rlhf.tasks:task_reward"
    # An HF *ForSequenceClassification checkpoint folder scoring (prompt, completion) chats; replaces `reward`
    reward_model: Optional[str] = None
    # Without data=: a reasoning-gym task generated offline (seeded), and its options
    task: str = "basic_arithmetic"
    # (single-digit sums and differences: the built-in SmolLM2 answers about a fifth of them before training)
    task_options: dict = field(default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                        "max_digits": 1, "operators": ["+", "-"],
                                                        "allow_negation": False, "allow_parentheses": False})
    train_prompts: int = 2000  # task prompts generated for training
    eval_prompts: int = 64  # held-out task prompts, answered greedily every eval_every steps (eval/reward)
    eval_every: int = 10  # 0: never
    eval_samples: int = 4  # sampled answers per held-out prompt besides the greedy one (eval/reward_sampled); 0: none
    num_generations: int = 4  # completions per prompt (GRPO's group: at least 2)
    prompts_per_step: int = 8
    max_tokens: int = 64  # per completion
    temperature: float = 1.0
    updates_per_batch: int = 1  # optimizer updates per rollout batch (the old log-probabilities are kept)
    clip_low: float = 0.2  # the ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    kl_coef: float = 0.0  # KL penalty to the reference policy (0: none; the KL is still reported)
    kl_estimator: str = "k3"  # k1 | k3
    # At kl_coef 0 the KL is only reported, estimated on this share of a step's completions (0: none; kl reads 0)
    kl_report_fraction: float = 0.25
    loss_level: str = "token"  # token | sequence: how the policy loss averages
    scale_rewards: bool = True  # divide group advantages by the group's std (false: Dr. GRPO)
    tis_cap: Optional[float] = None  # truncated importance sampling of the policy loss (e.g. 2.0); None: off
    reference_on_host: bool = False  # all weights training: keep the frozen reference copy in host memory
    max_logprob_diff: float = 1e-3  # the engine's and the trainer's log-probabilities may differ this much (mean)
    # The trainer's forward packs a prompt once with as many of its completions as fit in this many tokens
    # (each attends to the prompt and itself); 0: one row per completion, the prompt repeated in each
    pack_tokens: int = 4096
    # PPO: GAE's discount and lambda, the value loss's weight and clip (None: unclipped), whitened advantages
    gamma: float = 1.0
    lam: float = 0.95
    vf_coef: float = 0.1
    value_clip: Optional[float] = 0.2
    whiten_advantages: bool = True


@dataclass
class ClipTowerConfig:
    """A fresh CLIP vision tower and LLaVA projector, composed with a text checkpoint into a LLaVA model."""
    image_size: int = 32
    patch_size: int = 16  # (image_size / patch_size)^2 image tokens per image
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4


@dataclass
class VisionDemoConfig:
    tower: ClipTowerConfig = field(default_factory=ClipTowerConfig)
    heldout_per_class: int = 30  # lfw faces and non-faces kept out of training, for the evaluation
    tower_steps: int = 24  # phase 1: tower and projector train (at train.lr), the language model frozen
    projector_steps: int = 6  # phase 2: the projector alone
    projector_lr: float = 5e-4  # phase 2 refines what phase 1 learned: a lower rate than train.lr


@dataclass
class OnlineConfig:
    server: Optional[str] = None  # base URL of the running server to hot-swap (http://host:port); None: train and gate only
    heldout: Optional[str] = None  # JSONL of conversations whose behaviour must not change; None: the log's unrated ones
    min_parity_cosine: float = 0.98  # mean logits cosine, candidate vs current model, on the held-back set
    min_improvement: float = 0.05  # nats per token the candidate must gain on the accepted replies


@dataclass
class PlanConfig:
    """recipe=plan (unified/plan): will this model fit, and how best to lay it out."""
    hardware: str = "cpu"  # a name in configs/hardware/ (h100, h200, mtt-s4000, mtt-s5000, cpu) or a YAML file's path
    cards: int = 1  # accelerators (or, for cpu, processes on this machine) to lay the model out on
    context: Optional[int] = None  # tokens per sequence; None: engine.max_model_len or the model's (serve), train.seq_len (train)
    mode: str = "serve"  # serve | train
    probe: str = "on"  # on | warn | off: what a recipe that loads a model does when the plan says it cannot fit
    # Storage of the weights: auto (the compute dtype, as the engine holds them) | fp8 | int8 | int4 (the
    # projections kept quantized as checkpoints store them; see unified/plan/weight_bytes.py)
    weights: str = "auto"
    expert_load: float = 1.0  # routed tokens per expert over the balanced share (1: balanced routing)
    top: int = 10  # feasible layouts listed


@dataclass
class RunConfig:
    job: str = MISSING  # which job the recipe runs
    model: str = "smollm2"  # a checkpoint folder or a built-in model name
    data: Optional[str] = None
    input: Optional[str] = None
    output: Optional[str] = None
    prompt: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8000
    steps: Optional[int] = None
    seed: int = 0
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    check: ParityCheckConfig = field(default_factory=ParityCheckConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rlhf: RLHFConfig = field(default_factory=RLHFConfig)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    vision_demo: VisionDemoConfig = field(default_factory=VisionDemoConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    store.store(group="device", name="device_schema", node=DeviceConfig)
    store.store(group="parallel", name="parallel_schema", node=ParallelConfig)
    store.store(group="engine", name="engine_schema", node=EngineConfig)
    store.store(group="serve", name="serve_schema", node=ServeConfig)
    store.store(group="train", name="train_schema", node=TrainConfig)
    store.store(group="rlhf", name="rlhf_schema", node=RLHFConfig)
