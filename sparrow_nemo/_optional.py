"""Lazy imports of optional packages, with an error that says which extra provides them."""

from __future__ import annotations

import importlib
from types import ModuleType

#: optional module -> (pip extra, what this project uses it for)
OPTIONAL_MODULES: dict[str, tuple[str, str]] = {
    "tensorrt_llm": ("cluster", "the TensorRT-LLM rollout engine (rollout.backend=trtllm)"),
    "transformer_engine": ("cluster", "fused Transformer Engine layers for the megatron policy on GPU"),
    "apex": ("cluster", "fused optimizers and norms in the cluster image"),
    "nemo": ("cluster", "NeMo toolkit integrations"),
    "triton": ("kernels", "the fused sparse decode-attention kernels (sparrow_kernels)"),
    "tensorboard": ("tensorboard", "TensorBoard metric logging (logging.tensorboard=true)"),
}


class MissingOptionalDependency(ImportError):
    """An optional package is needed for a feature the config asked for."""


def require(module: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingOptionalDependency` naming the extra.

    >>> require("math").pi > 3
    True
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra, purpose = OPTIONAL_MODULES.get(module.split(".")[0], ("", "an optional feature"))
        hint = f"pip install 'sparrow-nemo[{extra}]'" if extra else f"pip install {module}"
        raise MissingOptionalDependency(
            f"'{module}' is not installed; it is needed for {purpose}. Install it with: {hint}"
        ) from exc


def is_available(module: str) -> bool:
    """True when ``module`` can be imported (does not raise)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
