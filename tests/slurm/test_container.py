"""docker/Dockerfile stays consistent with the code it packages (it cannot be built on CPU CI machines).

Checked: the base image's TensorRT-LLM version is the one the rollout engine was written against; the
requirements step (the Python snippet embedded in the Dockerfile) yields the package's dependencies
without torch; the build context leaves out the virtualenv, runs and images; the sbatch wrappers default
to the image file the Dockerfile's instructions produce.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from sparrow_nemo.rollout.trtllm.engine import TRTLLM_VERSION

from .conftest import REPO_ROOT

DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"


def test_base_image_is_the_pinned_tensorrt_llm() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(rf"^ARG TRTLLM_VERSION={re.escape(TRTLLM_VERSION)}$", text, re.M)
    assert re.search(r"^FROM nvcr\.io/nvidia/tensorrt-llm/release:\$\{TRTLLM_VERSION\}$", text, re.M)


def test_requirements_step_installs_every_dependency_but_torch() -> None:
    snippet = re.search(r"<<'PY' > /tmp/requirements.txt\n(.*?)\nPY\n", DOCKERFILE.read_text(), re.S)
    assert snippet, "the requirements heredoc is missing from docker/Dockerfile"
    done = subprocess.run(
        [sys.executable, "-c", snippet.group(1)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    listed = done.stdout.split()
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert listed == [d for d in deps if not d.startswith("torch")]
    assert any(d.startswith("megatron-core") for d in listed)


def test_build_context_leaves_out_local_state() -> None:
    ignored = (REPO_ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv", "runs", "*.sqsh"} <= set(ignored)


def test_gpu_wrappers_default_to_the_image_the_dockerfile_builds() -> None:
    built = re.search(r"enroot import -o (\S+) dockerd://sparrow-nemo", DOCKERFILE.read_text()).group(1)
    for script in sorted((REPO_ROOT / "slurm").glob("train_qwen3_*.sh")):
        assert f"SPARROW_IMAGE=${{SPARROW_IMAGE-{built}}}" in script.read_text(), script.name


def test_no_apex_build_and_torch_and_triton_stay_the_images() -> None:
    text = DOCKERFILE.read_text()
    run_lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not any("apex" in line for line in run_lines), "docker/Dockerfile builds apex, which nothing needs"
    installs = [line for line in run_lines if "pip install" in line]
    assert not any(re.search(r"\b(torch|triton)\b[<>=]", line) for line in installs), installs
    # the image's torch and Triton, frozen before the dependencies go in, constrain that install
    pins = text.index("pip list --format=freeze | grep -E '^(torch|triton)==' > /tmp/image-constraints.txt")
    assert pins < text.index("pip install -c /tmp/image-constraints.txt -r /tmp/requirements.txt")
