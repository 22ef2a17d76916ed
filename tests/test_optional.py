"""Optional cluster packages fail with an error naming the extra."""

from __future__ import annotations

import pytest

from sparrow_nemo._optional import MissingOptionalDependency, is_available, require


def test_missing_cluster_package_names_the_extra() -> None:
    if is_available("tensorrt_llm"):
        pytest.skip("tensorrt_llm is installed here")
    with pytest.raises(MissingOptionalDependency, match=r"sparrow-nemo\[cluster\].*") as info:
        require("tensorrt_llm")
    assert "TensorRT-LLM rollout engine" in str(info.value)


def test_present_module_imports() -> None:
    assert require("json").dumps([1]) == "[1]"
