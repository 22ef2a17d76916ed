"""Forward (and backward) over micro-batches through the pipeline stages.

- megatron branch (GPU): megatron-core's own schedule (``get_forward_backward_func``: no pipelining
  for pp=1, 1F1B for pp>1), with megatron's DDP grad sync hooked in through the model config
  (:func:`sparrow_nemo.policy.optim.wrap_for_training`).
- torch branch (CPU, and the LoRA adapter's step): megatron's schedules allocate on ``"cuda"`` (token
  counters, p2p shape buffers), so a plain torch GPipe schedule is used instead: all forwards
  (``dist.send``/``dist.recv`` of the ``[S, B, H]`` activations between stages), then all backwards in
  reverse order (the activation gradient goes back the same way). Same arithmetic, more activation
  memory; fine at CPU sizes.

In both, each micro-batch's loss is multiplied by ``loss_scale`` before its backward and nothing else:
megatron's own division by the number of micro-batches is switched off (``calculate_per_token_loss``,
set by ``wrap_for_training``), so the caller (:func:`sparrow_nemo.policy.train_step.train_step`) alone
decides how micro-batch losses combine. :class:`LogprobOutput` is computed on the last stage from the
final hidden states by the chunked output layer (see :mod:`sparrow_nemo.policy.logprobs`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.logprobs import TOP_K, LogprobOutput, policy_outputs
from sparrow_nemo.policy.model import PolicyModelSpec, unwrap_model

#: loss_fn(outputs, batch) -> (scalar loss of this micro-batch, metrics as python floats; keys ending in
#: ``_max`` / ``_min`` are reduced over micro-batches and ranks by max / min, the others like the loss)
LossFn = Callable[[LogprobOutput, PolicyBatch], tuple[torch.Tensor, dict[str, float]]]


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _torch_gpipe(
    model,
    spec: PolicyModelSpec,
    batches: list[PolicyBatch],
    loss_fn: LossFn | None,
    forward_only: bool,
    top_k: int,
    loss_scale: float,
) -> list[tuple[torch.Tensor, dict, LogprobOutput]]:
    """Plain torch pipeline (all forward, all backward); returns per-micro-batch results on the last stage."""
    from megatron.core import parallel_state as ps

    inner = unwrap_model(model)
    dtype = inner.config.pipeline_dtype or torch.float32
    device = next(inner.parameters()).device
    saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    results: list[tuple[torch.Tensor, dict, LogprobOutput]] = []
    for batch in batches:
        tokens, pos, mask = batch.model_inputs(device, spec.sequence_multiple)
        inp = None
        if not spec.pre_process:
            b, s = tokens.shape
            s //= spec.sequence_multiple  # sequence parallelism: this rank's share of the sequence
            inp = torch.empty((s, b, spec.shape.hidden_size), dtype=dtype, device=device)
            dist.recv(inp, src=ps.get_pipeline_model_parallel_prev_rank())
            inp.requires_grad_(not forward_only)
            inner.set_input_tensor(inp)
        with torch.set_grad_enabled(not forward_only):
            out = model(tokens, pos, mask)
            if not spec.post_process:
                dist.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
                saved.append((inp, out))
                continue
            lp = policy_outputs(model, out, batch, spec, top_k)
            loss, metrics = loss_fn(lp, batch) if loss_fn is not None else (out.new_zeros(()), {})
        saved.append((inp, loss * loss_scale))
        results.append((loss.detach(), metrics, lp.detach()))
    if not forward_only:
        for inp, out in reversed(saved):
            if spec.post_process:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
                out.backward(grad)
            if inp is not None:
                dist.send(inp.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    return results


def _megatron_schedule(
    model,
    spec: PolicyModelSpec,
    batches: list[PolicyBatch],
    loss_fn: LossFn | None,
    forward_only: bool,
    top_k: int,
    loss_scale: float,
) -> list[tuple[torch.Tensor, dict, LogprobOutput]]:
    """megatron-core's schedule (GPU branch). Results per micro-batch on the last stage.

    ``loss_func`` returns megatron's 3-tuple ``(loss * loss_scale, num_tokens, reduced)``; with
    ``config.calculate_per_token_loss`` (set by ``wrap_for_training``) megatron backpropagates the first
    as is, and the finalize hook ignores ``num_tokens``. Without it megatron would divide the returned
    tensor in place (``output_tensor /= num_microbatches``), so the logged loss is a separate clone.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = _device()
    if not forward_only and not unwrap_model(model).config.calculate_per_token_loss:
        raise RuntimeError("megatron schedule: wrap the model with policy.optim.wrap_for_training first")

    def loss_func(batch: PolicyBatch, hidden: torch.Tensor):
        lp = policy_outputs(model, hidden, batch, spec, top_k)
        loss, metrics = loss_fn(lp, batch) if loss_fn is not None else (hidden.sum() * 0.0, {})
        num_tokens = batch.target_mask().sum().to(device=hidden.device, dtype=torch.int)
        reduced = {"loss": loss.detach().clone(), "metrics": metrics, "outputs": lp.detach()}
        return loss * loss_scale, num_tokens, reduced

    def forward_step(data_iterator, step_model):
        batch = next(data_iterator)
        tokens, pos, mask = batch.model_inputs(device, spec.sequence_multiple)
        return step_model(tokens, pos, mask), partial(loss_func, batch)

    b, s = batches[0].tokens.shape
    store = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=s,
        micro_batch_size=b,
        forward_only=forward_only,
    )
    if not spec.post_process:
        return []
    return [(d["loss"], d["metrics"], d["outputs"]) for d in store]


def run_microbatches(
    model: torch.nn.Module,
    spec: PolicyModelSpec,
    batches: list[PolicyBatch],
    loss_fn: LossFn | None = None,
    forward_only: bool = False,
    top_k: int = TOP_K,
    loss_scale: float = 1.0,
    megatron: bool | None = None,
) -> list[tuple[torch.Tensor, dict, LogprobOutput]]:
    """Forward (+ backward unless ``forward_only``) of every micro-batch; gradients accumulate in the model.

    Micro-batches may differ in ``[B, S]`` (pipeline stages exchange shapes: ``variable_seq_lengths``).

    Args:
        loss_scale: each micro-batch's loss is multiplied by this before its backward.
        megatron: megatron-core's schedule (the GPU branch) or the torch GPipe one; None = megatron's when
            CUDA is available.

    Returns:
        On the last pipeline stage, per micro-batch ``(loss, metrics, outputs)`` (the unscaled loss, detached;
        ``outputs`` detached); on other stages an empty list.
    """
    if not batches:
        raise ValueError("run_microbatches needs at least one micro-batch")
    if not forward_only and loss_fn is None:
        raise ValueError("a training pass (forward_only=False) needs a loss_fn")
    if megatron is None:
        megatron = torch.cuda.is_available()
    run = _megatron_schedule if megatron else _torch_gpipe
    return run(model, spec, batches, loss_fn, forward_only, top_k, loss_scale)


def broadcast_from_last_stage(spec: PolicyModelSpec, value):
    """``value`` from the last pipeline stage, on every stage of this pipeline."""
    if spec.layout.pp == 1:
        return value
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    holder = [value]
    dist.broadcast_object_list(holder, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
    return holder[0]


@torch.no_grad()
def compute_logprobs(
    model: torch.nn.Module,
    spec: PolicyModelSpec,
    batches: list[PolicyBatch],
    top_k: int = TOP_K,
    megatron: bool | None = None,
) -> list[LogprobOutput]:
    """Dense log-probs, entropy and top-k for each micro-batch, returned on every rank (CPU tensors).

    ``megatron``: which schedule (see :func:`run_microbatches`).
    """
    model.eval()
    results = run_microbatches(model, spec, batches, forward_only=True, top_k=top_k, megatron=megatron)
    return broadcast_outputs_from_last_stage(spec, [r[2] for r in results], batches)


def broadcast_outputs_from_last_stage(
    spec: PolicyModelSpec, outputs: list[LogprobOutput], batches: list[PolicyBatch]
) -> list[LogprobOutput]:
    """The last stage's per-micro-batch outputs on every stage of this pipeline, as tensor broadcasts.

    Nothing is pickled: one int64 [n, 3] header of (B, S-1, k) per micro-batch, then per micro-batch a
    float32 [B, S-1, 2 + k] tensor (logprobs, entropy, top-k logprobs) and an int64 [B, S-1, k] one (top-k
    ids), on the device the pipeline group communicates on. That is 8 + 12 k bytes per position (248 for
    k = 20: ~9.4 MB per 37,888-token row), sent within the pipeline group only. ``outputs`` is read on the
    last stage only (other stages pass ``[]``); the result holds CPU tensors with each batch's placement.
    """
    if spec.layout.pp == 1:
        return outputs
    from megatron.core import parallel_state as ps

    group, src, device = (
        ps.get_pipeline_model_parallel_group(),
        ps.get_pipeline_model_parallel_last_rank(),
        _device(),
    )
    if spec.post_process:
        header = torch.tensor([list(o.topk_ids.shape) for o in outputs], dtype=torch.int64, device=device)
    else:
        header = torch.empty(len(batches), 3, dtype=torch.int64, device=device)
    dist.broadcast(header, src=src, group=group)
    received = []
    for i, (b, s, k) in enumerate(header.tolist()):
        if spec.post_process:
            o = outputs[i]
            values = torch.cat([o.logprobs[..., None], o.entropy[..., None], o.topk_logprobs], dim=-1)
            values, ids = values.to(device, torch.float32).contiguous(), o.topk_ids.to(device).contiguous()
        else:
            values = torch.empty(b, s, 2 + k, dtype=torch.float32, device=device)
            ids = torch.empty(b, s, k, dtype=torch.int64, device=device)
        dist.broadcast(values, src=src, group=group)
        dist.broadcast(ids, src=src, group=group)
        values, ids = values.cpu(), ids.cpu()
        received.append(
            LogprobOutput(values[..., 0], values[..., 1], ids, values[..., 2:], batches[i].placement)
        )
    return received
