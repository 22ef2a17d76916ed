"""Export a run's trained policy as a Hugging Face Qwen3 checkpoint (NeMo-RL's ``convert_megatron_to_hf``,
verl's ``model_merger``): ``sparrow export --run-dir R [--step N] --out DIR``.

The run's resolved recipe (``R/config.yaml``) rebuilds the policy with the layout it trained with (a run of
TP x PP > 1 exports under ``torchrun`` with as many ranks); its step checkpoint (``--step N``, else the newest
complete one under ``checkpoint.dir`` or ``R/checkpoints``) is loaded with its hashes checked, the full
HF-named weights are gathered (:meth:`~sparrow_nemo.policy.policy.MegatronPolicy.export_hf`) and rank 0 writes:

- ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` with
  ``model.safetensors.index.json`` (what ``transformers`` and vLLM read);
- ``config.json`` (:func:`~sparrow_nemo.hf_qwen3.hf_config_dict`) and ``generation_config.json`` (the eos id,
  and the recipe's sampling: temperature, top_p, top_k);
- the tokenizer files of ``model.hf_checkpoint`` when the run started from one (the synthetic task's
  character tokenizer is not a Hugging Face one: none then);
- with DistillSparse (``distill.enabled``), its rollout-only LoRA in PEFT's format under ``<out>/distill_lora``
  (``adapter_config.json``: LORA, r, lora_alpha = scaling x r, target_modules; ``adapter_model.safetensors``:
  ``base_model.model.<module>.lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r]), which
  ``peft.PeftModel.from_pretrained(model, <out>/distill_lora)`` applies to the exported model.

The folder is written as ``<out>.partial`` and renamed when complete: a failed export leaves nothing at
``out``. An existing ``out`` is refused.

``checkpoint.save_hf: true`` writes the same folder from the live policy at the end of a training run
(:func:`save_run_hf`): ``<run_dir>/hf``, replacing the one of an earlier, shorter attempt of the run only once
the new one is complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

#: the folder in the run folder that ``checkpoint.save_hf`` writes at the end of a run
RUN_HF_DIR = "hf"
#: shard size of the exported safetensors (transformers' default is 5 GB too)
MAX_SHARD_BYTES = 5 * 10**9
#: tokenizer files copied from the start checkpoint when present
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


def find_checkpoint(run_dir: Path, checkpoint_dir: str | None, step: int | None) -> Path:
    """The step checkpoint to export: ``step_<step>``, else the newest complete one (a ValueError names the
    folder and the steps it holds)."""
    from sparrow_nemo.checkpoint.atomic import complete_checkpoints

    root = Path(checkpoint_dir or run_dir / "checkpoints")
    found = complete_checkpoints(root)
    if not found:
        raise ValueError(f"{root}: no complete checkpoint to export (was checkpoint.enabled false?)")
    if step is None:
        return found[0][1]
    for saved_step, path in found:
        if saved_step == step:
            return path
    raise ValueError(f"{root}: no complete checkpoint of step {step} (steps: {sorted(s for s, _ in found)})")


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in name order, cut into groups of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name].contiguous()
        size += nbytes
    return shards


def write_hf_folder(
    state: dict[str, torch.Tensor],
    config,
    out: str | Path,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    adapter: dict | None = None,
) -> Path:
    """Write the HF checkpoint folder of ``state`` (HF-named tensors) for the recipe ``config`` atomically, with
    the DistillSparse ``adapter`` state in PEFT's format when given."""
    from safetensors.torch import save_file

    from sparrow_nemo.hf_qwen3 import hf_config_dict

    out = Path(out)
    if out.exists():
        raise ValueError(f"{out}: already exists; export into a new folder")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shape = config.model.shape()
    dtype = next(iter(state.values())).dtype
    (staging / "config.json").write_text(json.dumps(hf_config_dict(shape, dtype), indent=2))
    r = config.rollout
    generation = {"eos_token_id": shape.eos_token_id, "do_sample": r.temperature > 0}
    generation |= {"temperature": r.temperature, "top_p": r.top_p} if r.temperature > 0 else {}
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=2))
    shards = _shards(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(staging / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k, shard in enumerate(shards, start=1):
            name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(staging / name), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(shard, name)
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    source = config.model.hf_checkpoint
    for name in TOKENIZER_FILES if source is not None else ():
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, staging / name)
    if adapter is not None:
        write_peft_adapter(adapter, staging / "distill_lora")
    staging.rename(out)
    return out


def write_peft_adapter(adapter: dict, out: Path) -> Path:
    """The DistillSparse adapter state (``{"weights": {HF module: (A, B)}, "scaling": float}``) as a PEFT
    LoRA folder ``out`` (module docstring)."""
    from safetensors.torch import save_file

    weights = adapter["weights"]
    ranks = {int(a.shape[0]) for a, _ in weights.values()}
    if len(ranks) != 1:
        raise ValueError(f"DistillSparse adapter: one LoRA rank expected, got {sorted(ranks)}")
    rank = ranks.pop()
    tensors = {}
    for module, (a, b) in weights.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": float(adapter["scaling"]) * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in weights}),
        "base_model_name_or_path": "..",
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Export the run folder's checkpoint (module docstring); collective over the launcher's ranks."""
    from sparrow_nemo.grpo import setup, world
    from sparrow_nemo.grpo.recipe import load_config

    run_dir = Path(run_dir)
    recipe = run_dir / "config.yaml"
    if not recipe.is_file():
        raise ValueError(f"{run_dir}: not a run folder (no config.yaml)")
    if Path(out).exists():
        raise ValueError(f"{out}: already exists; export into a new folder")
    config = load_config(recipe)
    checkpoint = find_checkpoint(run_dir, config.checkpoint.dir, step)
    world.start_processes(config.trainer.dist_timeout_minutes)
    setup.apply_cpu_threads(config)
    policy = setup.build_policy(config, None)
    try:
        policy.load(checkpoint)
        state = policy.export_hf()
        if world.rank() == 0:
            write_hf_folder(state, config, out, adapter=_distill_adapter(checkpoint))
    finally:
        policy.close()
    return Path(out)


def save_run_hf(policy, config, run_dir: Path) -> Path | None:
    """``checkpoint.save_hf``: the live ``policy`` of a finished run as ``<run_dir>/hf`` (module docstring), with
    its DistillSparse adapter in PEFT's format when it has one; returns the folder on rank 0, None elsewhere.

    Collective over the world: every rank takes part in the gathers of :meth:`export_hf` (tensor-parallel
    all-gathers, pipeline stages' tensors) and of the adapter's export; rank 0 alone writes. An ``hf`` folder
    already there (an earlier attempt of the run, extended since) is replaced once the new one is complete.
    """
    from sparrow_nemo.grpo import world

    state = policy.export_hf()
    adapter = None
    if policy.lora is not None:  # DistillSparse's rollout-only LoRA
        exported = policy.lora.export_adapter()
        adapter = {"weights": exported.weights, "scaling": exported.scaling}
    if world.rank() != 0:
        return None
    out = Path(run_dir) / RUN_HF_DIR
    if not out.exists():
        return write_hf_folder(state, config, out, adapter=adapter)
    fresh, old = out.with_name(RUN_HF_DIR + ".new"), out.with_name(RUN_HF_DIR + ".old")
    for leftover in (fresh, old):  # of an attempt killed while replacing
        shutil.rmtree(leftover, ignore_errors=True)
    write_hf_folder(state, config, fresh, adapter=adapter)
    out.rename(old)
    fresh.rename(out)
    shutil.rmtree(old)
    return out


def _distill_adapter(checkpoint: Path) -> dict | None:
    """The DistillSparse adapter state saved in ``checkpoint``, if the run had one."""
    from sparrow_nemo.checkpoint.run_state import read_run_state
    from sparrow_nemo.grpo.distill import STATE_KEY

    _, states = read_run_state(checkpoint)
    return states.get(STATE_KEY, {}).get("adapter")
