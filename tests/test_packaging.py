"""The package as shipped: every package of ours listed in pyproject.toml, the kernels' sources beside it
without shadowing Hugging Face's `kernels`."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from unified.kernels.sources import sources_root

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_for_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    ours = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "unified").rglob("__init__.py")}
    assert ours <= listed, f"add {sorted(ours - listed)} to [tool.setuptools] packages in pyproject.toml"


def test_kernel_sources_do_not_shadow_huggingface_kernels():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert sources_root() == ROOT / "kernels" and (sources_root() / "cpu" / "cpu_kernels.cpp").is_file()
    # From the repository root, where `kernels/` is a folder on sys.path: transformers must still import.
    code = "import transformers.modeling_utils, kernels, sys; print(kernels.__file__)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "site-packages" in result.stdout, result.stdout
