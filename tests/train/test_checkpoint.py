"""Training checkpoints in-process on one rank: a save resumes with the step and every RNG state, and a
checkpoint folder holding a pickle that would run code is refused, naming the file, before anything in it runs."""
from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from unified.errors import UserError
from unified.train import checkpoint

TAG = "step-0000003"


class Planted:
    """What a hostile checkpoint can hold: unpickling it calls open(marker, "w")."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(scope="module")
def engine(runtime, tiny_checkpoint):
    from unified.checkpoint import load_model
    from unified.config.schema import TrainConfig
    from unified.train.engine import initialize

    model = load_model(tiny_checkpoint("llama")).model
    model.train()
    return initialize(model, TrainConfig(zero_stage=1), torch.float32, 1, 10)  # ZeRO-1: optimizer states file too


@pytest.fixture(scope="module")
def saved(engine, runtime, tmp_path_factory):
    directory = tmp_path_factory.mktemp("run") / "checkpoints"
    checkpoint.save(engine, directory, 3, runtime, keep=2, partial=False)
    return directory


def _copy(saved, tmp_path):
    return shutil.copytree(saved, tmp_path / "checkpoints")


def _draws(accelerator) -> list:
    return [torch.rand(3).tolist(), accelerator.get_rng_state().tolist(), random.random(), np.random.rand(3).tolist()]


def test_resume_restores_the_step_and_every_rng_state(engine, runtime, tmp_path):
    directory = tmp_path / "checkpoints"
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    checkpoint.save(engine, directory, 3, runtime, keep=2, partial=False)
    want = _draws(runtime)
    torch.manual_seed(2), random.seed(2), np.random.seed(2)
    assert checkpoint.resume(engine, directory, runtime, partial=False) == 3
    assert _draws(runtime) == want
    checkpoint.load_plain(directory / TAG / "rng_rank00000.pt")  # plain data: nothing to allowlist


def test_rng_files_written_with_numpy_arrays_still_resume(engine, runtime, saved, tmp_path):
    directory = _copy(saved, tmp_path)
    np.random.seed(5)
    torch.save({"torch": torch.get_rng_state(), "accelerator": runtime.get_rng_state(), "python": random.getstate(),
                "numpy": np.random.get_state()}, directory / TAG / "rng_rank00000.pt")  # the format before
    want = np.random.rand(3).tolist()
    np.random.seed(6)
    assert checkpoint.resume(engine, directory, runtime, partial=False) == 3
    assert np.random.rand(3).tolist() == want


@pytest.mark.parametrize("name", ["rng_rank00000.pt", "mp_rank_00_model_states.pt",
                                  "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_a_planted_pickle_is_refused_before_it_runs(engine, runtime, saved, tmp_path, name):
    directory = _copy(saved, tmp_path)
    path = directory / TAG / name
    state = torch.load(path, weights_only=False)  # our own file
    torch.save({**state, "planted": Planted(tmp_path / "proof")}, tmp_path / "proof.pt")
    torch.load(tmp_path / "proof.pt", weights_only=False)
    assert (tmp_path / "proof").exists(), "the planted pickle does not run code: the test proves nothing"

    marker = tmp_path / "ran"
    torch.save({**state, "planted": Planted(marker)}, path)
    with pytest.raises(UserError, match=re.escape(f"{path} is not plain checkpoint data (io.open)")):
        checkpoint.resume(engine, directory, runtime, partial=False)
    assert not marker.exists()


def test_deepspeed_files_may_hold_only_what_deepspeed_stores(engine, runtime, saved, tmp_path):
    directory = _copy(saved, tmp_path)
    path = directory / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    # Harmless, and allowed for the whole process by megatron-core, but not what DeepSpeed writes.
    torch.save({**torch.load(path, weights_only=False), "where": Path("/tmp")}, path)
    with pytest.raises(UserError, match=re.escape(f"{path} is not plain checkpoint data (pathlib.PosixPath)")):
        checkpoint.resume(engine, directory, runtime, partial=False)


def test_a_truncated_file_is_named(engine, runtime, saved, tmp_path):
    directory = _copy(saved, tmp_path)
    path = directory / TAG / "mp_rank_00_model_states.pt"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(UserError, match=re.escape(f"{path} is not a readable checkpoint file")):
        checkpoint.resume(engine, directory, runtime, partial=False)
