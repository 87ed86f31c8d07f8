"""The configuration tree: dataclasses with a docstring under every field (``--help`` prints them).

Each section validates its own values and names the dotted option in its
errors.  Building a Config from defaults, a TOML file and command-line
overrides, and writing it back, is ``hpcnet.config.load``'s.  The ``fault`` section is
``hpcnet.config.injection``'s, the bound of every duration ``hpcnet.config.durations``'s (both
re-exported here).
"""

import math
from dataclasses import dataclass, field
from typing import Any

from hpcnet.config.durations import MAX_DURATION_S, check_durations
from hpcnet.config.importing import is_import_path
from hpcnet.config.injection import FaultConfig
from hpcnet.config.optimizers import OPTIMIZERS, REFUSED
from hpcnet.errors import ConfigError
from hpcnet.observe.trace import parse_steps

MAX_SEED = 2**63 - 1
"""The largest ``run.seed``: it is written to config.toml, whose integers are 64-bit signed, and the
per-rank seeds derived from it (``seed + 1 + rank`` for torch, an unsigned 64-bit seed) stay in range."""


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """The ``run`` section: run directory, seed and logging."""

    name: str = "hpcnet"
    """Run name; the run directory is ``<run.dir>/<run.name>-<timestamp>`` unless run.dir_exact is set."""
    dir: str = "runs"
    """Parent directory of run directories (logs, metrics, resolved config)."""
    dir_exact: bool = False
    """Use ``run.dir`` itself as the run directory instead of a new timestamped one inside it."""
    seed: int = 0
    """Seed for model initialisation, data order and every rank's RNG: an integer in [0, 2**63 - 1]."""
    log_every: int = 10
    """Print a progress line on rank 0 every this many steps."""
    metrics: str = "rank0"
    """Write JSON-lines metrics from: 'rank0', 'all' ranks, or 'none'."""
    tensorboard: bool = False
    """Also write TensorBoard event files from rank 0 into <run directory>/tensorboard (needs the 'tensorboard' extra:
    pip install 'hpcnet[tensorboard]')."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"run.name: {self.name!r} must be a non-empty name without '/'")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"run.seed must be an integer in [0, 2**63 - 1], got {self.seed!r}")
        if self.log_every < 1:
            raise ConfigError("run.log_every must be at least 1")
        if self.metrics not in ("rank0", "all", "none"):
            raise ConfigError(f"run.metrics: {self.metrics!r} is not one of 'rank0', 'all', 'none'")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The ``model`` section: which model to train."""

    name: str = "resnet_tiny"
    """Built-in model: resnet18/34/50/101/152, resnet_tiny, mlp or transformer."""
    factory: str = ""
    """Import path 'package.module:function' of your own model factory, called as fn(info, **options); overrides
    model.name."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the model factory, e.g. model.options.hidden=[1024,1024]."""
    hf: str = ""
    """A Hugging Face model: a local config.json, or a local model directory (config.json, with weights or without);
    built with AutoModelForCausalLM for token datasets, AutoModelForSequenceClassification for sequence datasets (one
    class a sequence; other kinds are an error), from_pretrained when weights are there, else from_config; offline;
    model.options override config fields (docs/models.md). Needs the 'hf' extra: pip install 'hpcnet[hf]'. Overrides
    model.name; excludes model.factory."""
    loss: str = ""
    """Import path 'package.module:function' of the training objective, called as fn(model, batch) -> loss or
    (loss, {name: tensor}) for every micro-batch and in evaluation; batch is what the dataset yields (tensors,
    tuples, dicts), on the device. Empty: cross-entropy of the output (or of its .logits), or the output's own .loss."""
    blocks: str = "auto"
    """The model's blocks, which train.activation_checkpointing recomputes and dist.zero=3 gathers one at a time:
    'auto' (of the module classes repeated side by side, as the layers of a ModuleList, the one holding the most
    parameters: a transformer's layers, a ResNet's basic blocks), a class 'package.module.Class' (its outermost
    instances), or module paths 'blocks.0,blocks.1'."""

    def __post_init__(self) -> None:
        if not self.blocks.strip():
            raise ConfigError("model.blocks must not be empty: 'auto', a class 'package.module.Class' or module paths")
        if self.factory and not is_import_path(self.factory):
            raise ConfigError(f"model.factory: {self.factory!r} is not of the form 'package.module:function'")
        if self.loss and not is_import_path(self.loss):
            raise ConfigError(f"model.loss: {self.loss!r} is not of the form 'package.module:function'")
        if self.hf and self.factory:
            raise ConfigError("model.hf and model.factory both name the model: set one of them")

    def describe(self) -> str:
        """What builds the model, as the logs name it: ``hf PATH``, the factory, or the built-in name."""
        return f"hf {self.hf}" if self.hf else self.factory or self.name


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """The ``data`` section: which dataset to train on, where it is cached, shuffling and per-rank batch sizes."""

    dataset: str = "synthetic-images"
    """'synthetic-images', 'synthetic-tokens', a path to an HDF5 file, or 'package.module:function'."""
    dir: str = "data"
    """Where the built-in synthetic datasets are generated (once) and cached."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for a dataset factory given by import path."""
    shuffle: bool = True
    """Reshuffle the training set every epoch (a seeded permutation)."""
    balance: str = "off"
    """Per-rank batch sizes: 'off' (train.batch_size on every rank) or 'auto' (the global batch split in proportion to
    each rank's measured forward+backward speed, re-decided every data.balance_every steps; the update is the same mean
    over the same global batch)."""
    balance_every: int = 20
    """Steps per measuring window of data.balance=auto; the ranks agree on new sizes after each."""

    def __post_init__(self) -> None:
        if not self.dataset:
            raise ConfigError("data.dataset must not be empty")
        if self.balance not in ("off", "auto"):
            raise ConfigError(f"data.balance must be 'off' or 'auto', got {self.balance!r}")
        if self.balance_every < 2:
            raise ConfigError(f"data.balance_every must be at least 2 steps, got {self.balance_every}")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """The ``optim`` section: optimizer and learning-rate schedule."""

    name: str = "sgd"
    """Optimizer, one of torch's by its lower-case name: 'sgd' (with optim.momentum), 'adamw', 'adam', 'nadam',
    'radam', 'adamax', 'adagrad', 'rmsprop', 'adadelta', 'asgd', 'rprop', 'adafactor', or 'muon' (Muon for the hidden
    matrices, AdamW with optim.betas and optim.eps for the embeddings, the output layer and every other parameter:
    docs/memory.md); lbfgs and sparseadam are refused.  Ignored with optim.factory."""
    options: dict[str, Any] = field(default_factory=dict)
    """Further keyword options of the optimizer's constructor (torch's documented ones), e.g.
    optim.options.amsgrad=true; optim.lr, optim.weight_decay and the optim.* options the optimizer takes are set
    by their own names.  With 'muon', Muon's (e.g. ns_steps; adjust_lr_fn is 'match_rms_adamw' unless given)."""
    factory: str = ""
    """Import path 'package.module:function' of your own optimizer, called as fn(param_groups, cfg) with the
    weight-decay groups (2-D and larger with optim.weight_decay, the rest without) and this section; it returns a
    torch.optim.Optimizer and may regroup.  Overrides optim.name."""
    elementwise: bool = False
    """With optim.factory: the optimizer updates each element from its own gradient and state alone (as Adam,
    Lion), so dist.zero may cut a large parameter into row ranges; otherwise (and unless its class says
    elementwise = True) every parameter is owned and stepped whole."""
    lr: float = 0.05
    """Peak learning rate, reached at the end of warm-up."""
    momentum: float = 0.9
    """SGD momentum."""
    nesterov: bool = False
    """Use Nesterov momentum with SGD."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon, > 0: added to the denominator so an update never divides by zero."""
    weight_decay: float = 5e-4
    """Weight decay (decoupled for AdamW)."""
    warmup_steps: int = 20
    """Linear warm-up from 0 to optim.lr over this many steps."""
    decay: str = "cosine"
    """Learning-rate decay after warm-up: 'cosine', 'linear' or 'constant'."""
    min_lr_ratio: float = 0.05
    """Final learning rate as a fraction of optim.lr."""
    schedule: str = ""
    """Another learning-rate schedule, in place of optim.warmup_steps, optim.decay and optim.min_lr_ratio: one of
    torch.optim.lr_scheduler's by its class name (StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR,
    CosineAnnealingWarmRestarts, OneCycleLR, CyclicLR, PolynomialLR, LinearLR, ConstantLR; ReduceLROnPlateau steps on
    the global loss logged every run.log_every steps), or 'package.module:function', called as fn(optimizer,
    total_steps, **optim.schedule_options) -> a torch LRScheduler of that optimizer. Stepped once a step, from each
    param group's first learning rate; its state is in every checkpoint. Empty: the warm-up and decay above."""
    schedule_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of optim.schedule, e.g. optim.schedule_options.step_size=100; CosineAnnealingLR's T_max and
    OneCycleLR's total_steps are train.steps unless given. A step count below 1, or a schedule whose learning rate
    turns negative or not finite in its first 10,000 steps (computed at start-up), is refused."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    def __post_init__(self) -> None:
        if self.name in REFUSED:
            raise ConfigError(f"optim.name: {self.name!r} is not supported: {REFUSED[self.name]}")
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"optim.name: {self.name!r} is not one of {', '.join(map(repr, OPTIMIZERS))} "
                              f"(or give optim.factory='package.module:function')")
        if self.factory and not is_import_path(self.factory):
            raise ConfigError(f"optim.factory: {self.factory!r} is not of the form 'package.module:function'")
        if self.elementwise and not self.factory:
            raise ConfigError(f"optim.elementwise is for optim.factory's optimizer; optim.name={self.name}'s is "
                              f"known")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"optim.lr must be a positive number, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"optim.momentum must be in [0, 1), got {self.momentum}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ConfigError(f"optim.eps must be a positive number (it keeps AdamW's division by the root of its "
                              f"second moment finite), got {self.eps}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ConfigError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay not in ("cosine", "linear", "constant"):
            raise ConfigError(f"optim.decay: {self.decay!r} is not one of 'cosine', 'linear', 'constant'")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.schedule_options and not self.schedule:
            raise ConfigError("optim.schedule_options needs optim.schedule: the schedule they are options of")
        if not (self.grad_clip >= 0 and math.isfinite(self.grad_clip)):
            raise ConfigError(f"optim.grad_clip must be >= 0, got {self.grad_clip}")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The ``train`` section: steps, batch sizes, evaluation, threads, precision and tracing."""

    steps: int = 300
    """Number of optimizer steps."""
    batch_size: int = 32
    """Samples per rank per micro-batch; the global batch is batch_size * grad_accumulation * world size."""
    eval_every: int = 100
    """Evaluate on the held-out split every this many steps (and at the end); 0 disables."""
    eval_batches: int = 0
    """Limit evaluation to this many batches per rank; 0 evaluates the whole split."""
    grad_accumulation: int = 1
    """Micro-batches per optimizer step; gradients are communicated once per step, after the last."""
    threads: int = 0
    """Torch CPU threads per rank; 0 divides the node's cores among its ranks."""
    nonfinite: str = "stop"
    """At a non-finite loss, gradient norm or state: 'stop' (status 65, never saved), 'skip' the update, or 'ignore'."""
    precision: str = "fp32"
    """'fp32', or 'bf16': forward and loss under torch.autocast in bfloat16 (CPU and CUDA); parameters, gradients,
    optimizer state and checkpoints stay float32."""
    trace_steps: str = "11:12"
    """'START:END' (steps, inclusive): write trace.json, a Chrome/Perfetto timeline of those steps on every rank (steps,
    phases, collectives with bytes, checkpoint timings), clocks aligned over MPI; by default two steps after the first
    log line; empty: no trace."""
    trace_ops: bool = False
    """With train.trace_steps: also torch.profiler's operator (and CUDA kernel) events in the trace."""
    activation_checkpointing: str = "off"
    """'off'; 'blocks': each of the model's blocks (model.blocks) keeps only its input from forward to backward and
    recomputes its activations there (non-reentrant torch.utils.checkpoint): less memory for about one more forward,
    the same bits as without, at every dist.zero stage; 'auto' (needs dist.memory_cap_gb): as many of the first blocks
    as the memory planner finds the cap needs, none when it fits without."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"train.steps must be at least 1, got {self.steps}")
        if self.batch_size < 1:
            raise ConfigError(f"train.batch_size must be at least 1, got {self.batch_size}")
        if self.grad_accumulation < 1:
            raise ConfigError(f"train.grad_accumulation must be at least 1, got {self.grad_accumulation}")
        for name in ("eval_every", "eval_batches", "threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.nonfinite not in ("stop", "skip", "ignore"):
            raise ConfigError(f"train.nonfinite: {self.nonfinite!r} is not one of 'stop', 'skip', 'ignore'")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision: {self.precision!r} is not one of {', '.join(map(repr, PRECISIONS))}")
        try:
            parse_steps(self.trace_steps)
        except ValueError as exc:
            raise ConfigError(f"train.trace_steps: {exc}") from None
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ConfigError(f"train.activation_checkpointing: {self.activation_checkpointing!r} is not one of "
                              f"{', '.join(map(repr, ACTIVATION_CHECKPOINTING))}")
        if self.trace_ops and not self.trace_steps:
            raise ConfigError("train.trace_ops needs train.trace_steps ('START:END'): which steps to profile")


ACTIVATION_CHECKPOINTING = ("off", "blocks", "auto")
"""``train.activation_checkpointing`` values (``hpcnet.models.blocks``)."""
PRECISIONS = ("fp32", "bf16")
"""``train.precision`` values (``hpcnet.objective.autocast``)."""


@dataclass(kw_only=True, slots=True)
class DistConfig:
    """The ``dist`` section: backend and device, gradient buckets and compression, and parameter sharding."""

    backend: str = "auto"
    """Gradient all-reduce backend: 'auto' (nccl on GPU, mpi on CPU), 'fastest' (nccl on GPU; on CPU shm or mpi,
    whichever sums faster at start-up: the choice may differ between runs, and so may the last bits), 'nccl', 'gloo',
    'mpi' or 'shm' (CPU: buckets in node-shared memory, MPI across nodes)."""
    device: str = "auto"
    """'auto' (cuda:<local rank> when GPUs exist, else cpu), 'cpu' or 'cuda'."""
    timeout_s: float = 600.0
    """Timeout of torch.distributed set-up and of each step's gradient all-reduce, in seconds."""
    interface: str = ""
    """Network interfaces for the data plane: names or glob patterns, comma-separated (e.g. 'ib0' or 'eth*,ens*');
    each host uses the one of them that reaches rank 0's rendezvous address, and a host that has none is an error.
    Empty: each host chooses the interface that reaches rank 0 (same subnet, else the kernel's route)."""
    startup_timeout_s: float = 120.0
    """Deadline of each start-up phase on the network once MPI is up: the topology probe, the rendezvous, the first
    collective, the transport's process groups. Past it: stacks, failure.json (kind 'startup', the phase and the ranks
    that did not arrive), status 75. Needs monitor.enabled; monitor.startup_timeout_s bounds the whole start-up."""
    bucket_mb: float | str = 25.0
    """Gradient bucket size in MiB, or 'auto': from the probed latency and bandwidth, the smallest bucket whose latency
    is at most 5% of its all-reduce time (1-64 MiB, at most half the gradients; 25 without a probe)."""
    first_bucket_mb: float = 1.0
    """Size of the first bucket (the last layers), small so communication starts early; 0 = bucket_mb."""
    hierarchical: str = "auto"
    """Hierarchical all-reduce across nodes: 'auto' (where >1 node and the same number >1 of ranks on every node allow
    it and the sums are exact: hierarchical or flat, and the pipelined chunk, as the forecast from the probed links
    says is faster; without a probe, hierarchical), 'on' (an error on nodes of unequal sizes) or 'off'."""
    inter_node: str = "auto"
    """Between nodes on the hierarchical path under the mpi backend (CPU): 'gloo' (its sockets block while they wait,
    so the sums between nodes run beside backward without taking a core), 'primary' (MPI, which polls), or 'auto'
    (gloo when a rank has fewer than 2 cores of its own, as dist.progress decides; docs/communication.md). No effect
    elsewhere."""
    compression: str = "auto"
    """Wire format of gradients: 'auto' (exact, as 'none': lossy compression is never chosen for you; across nodes the
    log says what bf16 and int8 would save), 'none', 'fp16' or 'bf16' (lossy; nccl and gloo, and between the nodes of
    a hierarchical mpi route with gloo there, dist.inter_node; on one CPU node set dist.backend=gloo), or 'int8'
    (lossy: blockwise int8 with error feedback, the residuals saved in checkpoints; only between nodes, over gloo, on
    CPU backends: within a node the sums stay exact; docs/communication.md)."""
    fallback: str = "auto"
    """Backend to continue on when the primary fails: 'auto' (gloo for nccl/mpi, mpi for gloo), 'gloo', 'mpi',
    'none'."""
    progress: str = "auto"
    """Where the MPI transport's all-reduces run: 'thread' (a worker thread, overlapping backward), 'inline' (in the
    training thread, after backward: no hand-off), 'auto' (inline when a rank has fewer than 2 cores of its own)."""
    find_unused: bool = False
    """Allow parameters that get no gradient in a step (treated as zero); off makes that an error."""
    probe: bool = True
    """Measure the topology (latency and bandwidth between ranks) at start-up; written to topology.json."""
    fail_at_step: int = 0
    """Fault injection: make the primary backend fail at this global step, counted like fault.* (0 = never)."""
    fail_ranks: list[int] = field(default_factory=list)
    """Fault injection: the ranks on which the failure is seen; empty = every rank."""
    zero: int = 0
    """Sharded data parallelism (ZeRO): 0 = every rank holds all optimizer state and gradients; 1 = each parameter's
    optimizer state on its owner rank only, parameters all-gathered after the update; 2 = also its averaged gradient
    (reduce-scattered to the owner); 3 = also the parameter itself, gathered block by block (model.blocks) for each
    block's forward and backward and released after."""
    owners: str = "auto"
    """Who owns which parameter with dist.zero > 0: 'auto' (the cost model: bytes, the measured link and each rank's
    measured speed, so a slower rank owns less) or 'uniform' (bytes balanced, ranks taken as equal); written to
    owners.json."""
    reassign_every: int = 50
    """With dist.zero > 0 and dist.owners=auto: every this many steps the ranks repeat the start-up speed probe, and
    when a rank's relative speed moved by more than 25% and the cost model's step would be more than 10% shorter, the
    parameters get new owners (their optimizer state moved); 0 = keep the start-up owners."""
    memory_cap_gb: float = 0.0
    """Each rank's memory for training, GB (1e9 bytes); 0 = no cap. The memory planner (hpcnet.plan) measures one step
    at start-up and chooses dist.zero and train.activation_checkpointing, overriding both: the fastest choice whose
    predicted peak fits; it logs the prediction and, at the end, the measured peak beside it. Nothing fits: an error
    naming what would (more ranks, a smaller batch). 'python -m hpcnet.plan' prints the same without training."""

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "fastest", "nccl", "gloo", "mpi", "shm"):
            raise ConfigError(f"dist.backend: {self.backend!r} is not one of 'auto', 'fastest', 'nccl', 'gloo', "
                              "'mpi', 'shm'")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"dist.device: {self.device!r} is not one of 'auto', 'cpu', 'cuda'")
        if not self.timeout_s > 0:
            raise ConfigError(f"dist.timeout_s must be positive, got {self.timeout_s}")
        if not (math.isfinite(self.startup_timeout_s) and self.startup_timeout_s > 0):
            raise ConfigError(f"dist.startup_timeout_s must be a positive number of seconds, "
                              f"got {self.startup_timeout_s}")
        if isinstance(self.bucket_mb, str):
            if self.bucket_mb != "auto":
                raise ConfigError(f"dist.bucket_mb: expected a number of MiB or 'auto', got {self.bucket_mb!r}")
        elif not self.bucket_mb > 0:
            raise ConfigError(f"dist.bucket_mb must be positive, got {self.bucket_mb}")
        if self.first_bucket_mb < 0:
            raise ConfigError(f"dist.first_bucket_mb must be >= 0, got {self.first_bucket_mb}")
        if self.reassign_every < 0 or self.reassign_every == 1:
            raise ConfigError(f"dist.reassign_every must be 0 (never) or at least 2 steps, got {self.reassign_every}")
        if self.hierarchical not in ("auto", "on", "off"):
            raise ConfigError(f"dist.hierarchical: {self.hierarchical!r} is not one of 'auto', 'on', 'off'")
        if self.inter_node not in ("auto", "primary", "gloo"):
            raise ConfigError(f"dist.inter_node: {self.inter_node!r} is not one of 'auto', 'primary', 'gloo'")
        if self.compression not in ("auto", "none", "fp16", "bf16", "int8"):
            raise ConfigError(f"dist.compression: {self.compression!r} is not one of 'auto', 'none', 'fp16', 'bf16', "
                              "'int8'")
        if self.progress not in ("auto", "thread", "inline"):
            raise ConfigError(f"dist.progress: {self.progress!r} is not one of 'auto', 'thread', 'inline'")
        if self.fallback not in ("auto", "gloo", "mpi", "none"):
            raise ConfigError(f"dist.fallback: {self.fallback!r} is not one of 'auto', 'gloo', 'mpi', 'none'")
        if self.fail_at_step < 0:
            raise ConfigError(f"dist.fail_at_step must be >= 0, got {self.fail_at_step}")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ConfigError(f"dist.zero: {self.zero!r} is not one of 0, 1, 2, 3")
        if self.owners not in ("auto", "uniform"):
            raise ConfigError(f"dist.owners: {self.owners!r} is not one of 'auto', 'uniform'")
        if isinstance(self.memory_cap_gb, bool) or not isinstance(self.memory_cap_gb, (int, float)) \
                or not math.isfinite(self.memory_cap_gb) or self.memory_cap_gb < 0:
            raise ConfigError(f"dist.memory_cap_gb must be a number of GB >= 0 (0: no cap), got {self.memory_cap_gb!r}")
        check_durations(self, "dist")


SWITCHES = ("auto", "on", "off")
"""Values of the ``cuda.*`` switches: 'auto' is on for a CUDA device and off elsewhere."""
MATMUL_PRECISIONS = ("auto", "highest", "high", "medium")


@dataclass(kw_only=True, slots=True)
class CudaConfig:
    """The ``cuda`` section: device settings that apply on CUDA."""

    cudnn_benchmark: str = "auto"
    """torch.backends.cudnn.benchmark (autotuned convolutions for fixed input shapes): 'auto' (on CUDA), 'on', 'off'."""
    matmul_precision: str = "auto"
    """torch.set_float32_matmul_precision: 'auto' ('high', TF32 matmuls, on CUDA; 'highest' elsewhere), 'highest',
    'high', 'medium'."""
    channels_last: str = "auto"
    """Models with 2-d convolutions and their 4-d inputs in channels-last memory format: 'auto' (on CUDA), 'on' (any
    device), 'off'."""
    pin_memory: str = "auto"
    """Batches copied from pinned host memory on a side CUDA stream: 'auto' (on CUDA), 'on', 'off'; CUDA only."""
    fused_optimizer: str = "auto"
    """The fused implementation of SGD/AdamW (one kernel for all parameters): 'auto' (on CUDA), 'on' (any device),
    'off'."""

    def __post_init__(self) -> None:
        for name in ("cudnn_benchmark", "channels_last", "pin_memory", "fused_optimizer"):
            if getattr(self, name) not in SWITCHES:
                raise ConfigError(f"cuda.{name}: {getattr(self, name)!r} is not one of 'auto', 'on', 'off'")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ConfigError(f"cuda.matmul_precision: {self.matmul_precision!r} is not one of "
                              f"{', '.join(map(repr, MATMUL_PRECISIONS))}")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """The ``checkpoint`` section: where, when and how checkpoints are saved and loaded."""

    dir: str = ""
    """Checkpoint directory; empty means '<run.dir>/<run.name>.ckpt', shared by every run of that name."""
    every_steps: int = 0
    """Save every this many steps; 0 saves by time only."""
    every_s: float = 300.0
    """Save when this many seconds have passed since the last save; 0 disables time-based saves."""
    keep: int = 3
    """Keep the newest this many full checkpoints (and the increments that depend on them)."""
    full_every: int = 4
    """Every this many saves is a full checkpoint; the saves between are incremental. 1 makes every save full."""
    async_save: bool = True
    """Write in the background: the loop blocks only for a snapshot to host memory."""
    at_end: bool = True
    """Save once more when training finishes."""
    resume: str = ""
    """'' starts fresh, 'auto' resumes from the last committed checkpoint (fresh if none), or a checkpoint path."""
    resume_else: str = ""
    """With resume='auto': the checkpoint (file or directory) to resume from while checkpoint.dir holds no committed
    checkpoint yet; '' starts fresh then. For a run that starts from another run's checkpoint and is restarted or
    requeued: hpcnet.launch sets it on restarts."""
    move_aside: bool = False
    """A fresh run into a checkpoint.dir that holds checkpoints moves them into <dir>/aside-<time>-fresh-run/ (never
    deletes); false refuses to start."""
    timeout_s: float = 0.0
    """Deadline of each checkpoint save, background write, wait and load; 0 = max(120 s, 10 x the last save, size at 10
    MiB/s). Past it: stacks, failure.json (kind 'checkpoint'), status 75."""

    def __post_init__(self) -> None:
        for name in ("every_steps", "keep", "full_every"):
            if getattr(self, name) < (1 if name in ("keep", "full_every") else 0):
                raise ConfigError(f"checkpoint.{name} must be at least {1 if name != 'every_steps' else 0}, "
                                  f"got {getattr(self, name)}")
        if self.every_s < 0:
            raise ConfigError(f"checkpoint.every_s must be >= 0, got {self.every_s}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s >= 0):
            raise ConfigError(f"checkpoint.timeout_s must be a number of seconds >= 0 (0 = derived), "
                              f"got {self.timeout_s}")
        if self.resume_else and self.resume != "auto":
            raise ConfigError(f"checkpoint.resume_else needs checkpoint.resume=auto (it says where to start while "
                              f"checkpoint.dir holds no checkpoint), got checkpoint.resume={self.resume!r}")
        if self.resume_else == "auto":
            raise ConfigError("checkpoint.resume_else must be a checkpoint file or directory, not 'auto'")
        check_durations(self, "checkpoint")


@dataclass(kw_only=True, slots=True)
class MonitorConfig:
    """The ``monitor`` section: heartbeats, stall and desync detection, and the memory watch."""

    enabled: bool = True
    """Heartbeats, stall/desync detection and the memory watch (see docs/fault-tolerance.md)."""
    heartbeat_interval_s: float = 2.0
    """Every rank sends a heartbeat this often (a background thread on its own communicator)."""
    heartbeat_misses: int = 3
    """A rank that misses this many heartbeats in a row is declared failed."""
    stall_timeout_s: float = 0.0
    """A collective running longer than this is a stall; 0 derives it from the observed step time (see
    stall_floor_s)."""
    stall_floor_s: float = 30.0
    """The smallest stall timeout when it is derived from the step time, times the host's ranks per core where it has
    more ranks than cores."""
    startup_timeout_s: float = 600.0
    """Start-up (from the monitor's start to the first step, checkpoint loads not counted) must end within this; past
    it: stacks, failure.json (kind 'startup'), status 75."""
    memory_every_steps: int = 50
    """Sample resident memory (and GPU memory) every this many steps; 0 disables the leak watch."""
    memory_window: int = 10
    """Samples in the window over which steady growth is judged."""
    memory_growth_mb: float = 256.0
    """Warn when memory grew by more than this over the window, steadily."""

    def __post_init__(self) -> None:
        if not self.heartbeat_interval_s > 0:
            raise ConfigError(f"monitor.heartbeat_interval_s must be positive, got {self.heartbeat_interval_s}")
        if self.heartbeat_misses < 1:
            raise ConfigError(f"monitor.heartbeat_misses must be at least 1, got {self.heartbeat_misses}")
        for name in ("stall_timeout_s", "stall_floor_s", "memory_growth_mb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"monitor.{name} must be >= 0, got {getattr(self, name)}")
        if not (math.isfinite(self.startup_timeout_s) and self.startup_timeout_s > 0):
            raise ConfigError(f"monitor.startup_timeout_s must be a positive number of seconds, "
                              f"got {self.startup_timeout_s}")
        if self.memory_every_steps < 0:
            raise ConfigError(f"monitor.memory_every_steps must be >= 0, got {self.memory_every_steps}")
        if self.memory_window < 2:
            raise ConfigError(f"monitor.memory_window must be at least 2, got {self.memory_window}")
        check_durations(self, "monitor")
        if self.heartbeat_misses * self.heartbeat_interval_s > MAX_DURATION_S:  # a duration too: the silence allowed
            raise ConfigError(f"monitor.heartbeat_misses x monitor.heartbeat_interval_s (how long a rank may be "
                              f"silent) must be at most {MAX_DURATION_S} s (30 days), got {self.heartbeat_misses} x "
                              f"{self.heartbeat_interval_s:.10g} s")


@dataclass(kw_only=True, slots=True)
class Config:
    """Every option of a run, one dataclass per section."""

    run: RunConfig = field(default_factory=RunConfig)
    """Run directory, seed and logging."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which model to train."""
    data: DataConfig = field(default_factory=DataConfig)
    """Which dataset to train on."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch size, evaluation."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Distributed data plane."""
    cuda: CudaConfig = field(default_factory=CudaConfig)
    """GPU settings (cuDNN autotuning, TF32, channels-last, pinned batches, fused optimizers): on by default on CUDA."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Parallel-HDF5 checkpoints: when to save, what to keep, resume."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """Heartbeats, stall and desync detection, memory-leak watch."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """How a lost rank is recovered (fault.recovery), and fault injection for testing recovery (all off by
    default)."""

    def __post_init__(self) -> None:
        if self.train.activation_checkpointing == "auto" and not self.dist.memory_cap_gb:
            raise ConfigError("train.activation_checkpointing=auto needs dist.memory_cap_gb: the memory the blocks "
                              "must fit in (or choose 'blocks' or 'off')")
