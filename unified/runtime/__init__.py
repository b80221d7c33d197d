from unified.runtime.device import default_dtype, select_accelerator
from unified.runtime.distributed import current_layout, init_distributed, layout_world, shutdown_distributed
from unified.runtime.layout import Layout, LayoutError, check_layout
from unified.runtime.setup import Runtime, start_runtime

__all__ = ["Layout", "LayoutError", "Runtime", "check_layout", "current_layout", "default_dtype", "init_distributed",
           "layout_world", "select_accelerator", "shutdown_distributed", "start_runtime"]
