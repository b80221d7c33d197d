"""DeepSpeed accelerator for Moore Threads GPUs (device="musa").

DeepSpeed ships no MUSA backend, so this class maps its accelerator interface onto `torch.musa`
(added by the `torch_musa` plugin) and is installed with `deepspeed.accelerator.set_accelerator`.
torch_musa is imported only when the accelerator is built, so CUDA and CPU runs never need it.
"""
from __future__ import annotations

import functools

import torch
from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

from unified.errors import UserError

class TorchMusaMissing(UserError, RuntimeError):
    pass


_MISSING_TORCH_MUSA = (
    "device=musa needs the torch_musa package (Moore Threads' PyTorch plugin); install it for your "
    "MUSA driver, or choose device=cuda or device=cpu"
)


class MUSA_Accelerator(DeepSpeedAccelerator):

    def __init__(self):
        try:
            import torch_musa  # noqa: F401  (registers torch.musa and the "musa" device type)
        except ImportError as err:
            raise TorchMusaMissing(_MISSING_TORCH_MUSA) from err
        self._musa = torch.musa
        self._name = "musa"
        self._communication_backend_name = "mccl"
        self._compile_backend = "inductor"
        self._op_builders = {}

    def _musa_fn(self, *names):
        """The first of `names` that this torch_musa release provides (APIs vary across releases)."""
        for name in names:
            fn = getattr(self._musa, name, None)
            if fn is not None:
                return fn
        raise NotImplementedError(f"torch.musa provides none of {names}")

    def is_synchronized_device(self):
        return False

    def use_host_timers(self):
        return self.is_synchronized_device()

    def resolves_data_dependency(self):
        return self.is_synchronized_device()

    def handles_memory_backpressure(self):
        return self.is_synchronized_device()

    # Device APIs
    def device_name(self, device_index=None):
        return "musa" if device_index is None else f"musa:{device_index}"

    def device(self, device_index=None):
        return torch.device("musa", device_index)

    def set_device(self, device_index):
        self._musa.set_device(device_index)

    def current_device(self):
        return self._musa.current_device()

    def current_device_name(self):
        return f"musa:{self._musa.current_device()}"

    def device_count(self):
        return self._musa.device_count()

    def synchronize(self, device_index=None):
        return self._musa.synchronize(device_index)

    # RNG APIs
    def random(self):
        return torch.random

    def set_rng_state(self, new_state, device_index=None):
        if device_index is None:
            return self._musa.set_rng_state(new_state)
        return self._musa.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index=None):
        if device_index is None:
            return self._musa.get_rng_state()
        return self._musa.get_rng_state(device_index)

    def manual_seed(self, seed):
        return self._musa.manual_seed(seed)

    def manual_seed_all(self, seed):
        return self._musa.manual_seed_all(seed)

    def initial_seed(self):
        return self._musa.initial_seed()

    def default_generator(self, device_index):
        return self._musa.default_generators[device_index]

    # Streams/Events
    @property
    def Stream(self):
        return self._musa.Stream

    def stream(self, stream):
        return self._musa.stream(stream)

    def current_stream(self, device_index=None):
        return self._musa.current_stream(device_index)

    def default_stream(self, device_index=None):
        return self._musa.default_stream(device_index)

    @property
    def Event(self):
        return self._musa.Event

    # Memory management
    def empty_cache(self):
        return self._musa.empty_cache()

    def memory_allocated(self, device_index=None):
        return self._musa.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None):
        return self._musa.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index=None):
        return self._musa_fn("reset_max_memory_allocated", "reset_peak_memory_stats", "reset_peak_stats")(device_index)

    def memory_cached(self, device_index=None):
        return self._musa_fn("memory_cached", "memory_reserved")(device_index)

    def max_memory_cached(self, device_index=None):
        return self._musa_fn("max_memory_cached", "max_memory_reserved")(device_index)

    def reset_max_memory_cached(self, device_index=None):
        return self._musa_fn("reset_max_memory_cached", "reset_peak_memory_stats", "reset_peak_stats")(device_index)

    def memory_stats(self, device_index=None):
        return self._musa.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index=None):
        return self._musa_fn("reset_peak_memory_stats", "reset_peak_stats")(device_index)

    def memory_reserved(self, device_index=None):
        return self._musa.memory_reserved(device_index)

    def max_memory_reserved(self, device_index=None):
        return self._musa.max_memory_reserved(device_index)

    def total_memory(self, device_index=None):
        return self._musa.get_device_properties(device_index).total_memory

    def available_memory(self, device_index=None):
        if hasattr(self._musa, "mem_get_info"):
            return self._musa.mem_get_info(device_index)[0]
        return self.total_memory(device_index) - self.memory_allocated(device_index)

    # Data types
    def is_bf16_supported(self):
        check = getattr(self._musa, "is_bf16_supported", None)
        return True if check is None else check()

    def is_fp16_supported(self):
        return True

    def supported_dtypes(self):
        dtypes = [torch.float, torch.half]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    # Misc
    def is_available(self):
        return self._musa.is_available()

    def range_push(self, msg, domain=None, category=None):
        return None

    def range_pop(self, domain=None):
        return None

    def lazy_call(self, callback):
        return self._musa._lazy_call(callback)

    def communication_backend_name(self):
        return self._communication_backend_name

    def is_triton_supported(self):
        return False

    # Graph operations
    def is_current_stream_capturing(self) -> bool:
        check = getattr(self._musa, "is_current_stream_capturing", None)
        return False if check is None else check()

    def create_graph(self):
        return self._musa.MUSAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return self._musa.graph(graph, pool, stream)

    def replay_graph(self, graph):
        graph.replay()

    # Tensor operations
    @property
    def BFloat16Tensor(self):
        return functools.partial(torch.tensor, dtype=torch.bfloat16, device="musa")

    @property
    def ByteTensor(self):
        return functools.partial(torch.tensor, dtype=torch.uint8, device="musa")

    @property
    def DoubleTensor(self):
        return functools.partial(torch.tensor, dtype=torch.double, device="musa")

    @property
    def FloatTensor(self):
        return functools.partial(torch.tensor, dtype=torch.float, device="musa")

    @property
    def HalfTensor(self):
        return functools.partial(torch.tensor, dtype=torch.half, device="musa")

    @property
    def IntTensor(self):
        return functools.partial(torch.tensor, dtype=torch.int, device="musa")

    @property
    def LongTensor(self):
        return functools.partial(torch.tensor, dtype=torch.long, device="musa")

    def on_accelerator(self, tensor):
        return tensor.device.type == "musa"

    # Op builders: DeepSpeed has no MUSA kernels. Like the CPU accelerator, every name resolves to a
    # NotImplementedBuilder (DeepSpeed looks all builders up when deepspeed.ops.op_builder is
    # imported, so returning None or raising here would break that import); loading one fails.
    def op_builder_dir(self):
        return "deepspeed.ops.op_builder.cpu"

    def create_op_builder(self, class_name):
        return self.get_op_builder(class_name)()

    def get_op_builder(self, class_name):
        if class_name not in self._op_builders:
            from deepspeed.ops.op_builder.cpu import NotImplementedBuilder

            def load(builder, verbose=True):
                raise ValueError(f"DeepSpeed has no MUSA build of {class_name}; use a pure-PyTorch "
                                 "alternative (for Adam, set the optimizer param torch_adam: true)")

            self._op_builders[class_name] = type(f"MUSANotImplemented{class_name}", (NotImplementedBuilder, ), {
                "load": load,
                "is_compatible": lambda builder, verbose=False: False,
            })
        return self._op_builders[class_name]

    def build_extension(self):
        from torch.utils.cpp_extension import BuildExtension
        return BuildExtension

    def export_envs(self):
        return ["MUSA", "MCCL"]

    def visible_devices_envs(self):
        return ["MUSA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env, local_accelerator_ids):
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self):
        return self._compile_backend

    def set_compile_backend(self, backend):
        supported_backends = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported_backends:
            raise ValueError(
                f"{backend} not supported by {self.device_name()}. Supported Backends are {supported_backends}")
        self._compile_backend = backend
