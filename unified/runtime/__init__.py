from unified.runtime.device import default_dtype, select_accelerator
from unified.runtime.distributed import Layout, init_distributed
from unified.runtime.setup import Runtime, start_runtime

__all__ = ["Layout", "Runtime", "default_dtype", "init_distributed", "select_accelerator", "start_runtime"]
