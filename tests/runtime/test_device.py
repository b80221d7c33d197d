import pytest
import torch

from unified.errors import UserError
from unified.runtime import Layout, default_dtype, init_distributed, select_accelerator


def test_cpu_accelerator_is_deepspeeds(runtime):
    from deepspeed.accelerator import get_accelerator

    accelerator = select_accelerator("cpu")
    assert get_accelerator() is accelerator
    assert accelerator.device_name() == "cpu"
    assert accelerator.communication_backend_name() == "gloo"
    assert default_dtype(accelerator) == torch.float32
    assert default_dtype(accelerator, "bfloat16") == torch.bfloat16


def test_unknown_device_and_dtype_are_user_errors():
    with pytest.raises(UserError, match="device='tpu'"):
        select_accelerator("tpu")
    with pytest.raises(UserError, match="dtype='fp8'"):
        default_dtype(select_accelerator("cpu"), "fp8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_says_what_to_do():
    with pytest.raises(UserError, match="no CUDA device"):
        select_accelerator("cuda")


def test_world_of_one_without_launcher(runtime):
    import torch.distributed as dist
    from megatron.core import parallel_state

    assert dist.get_world_size() == 1
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert parallel_state.get_data_parallel_world_size() == 1


def test_impossible_layout_fails_before_anything_loads(runtime):
    with pytest.raises(UserError, match="world size 1 is not a multiple of tensor x pipeline = 2 x 1"):
        init_distributed(runtime, Layout(tensor=2))
