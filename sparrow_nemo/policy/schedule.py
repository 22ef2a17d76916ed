"""Forward (and backward) over micro-batches through the pipeline stages.

- GPU: megatron-core's own schedule (``get_forward_backward_func``: no pipelining for pp=1, 1F1B
  for pp>1), with megatron's DDP grad sync hooked in through the model config.
- CPU: megatron's schedules allocate on ``"cuda"`` (token counters, p2p shape buffers), so a plain
  torch GPipe schedule is used instead: all forwards (``dist.send``/``dist.recv`` of the
  ``[S, B, H]`` activations between stages), then all backwards in reverse order (the activation
  gradient goes back the same way). Same arithmetic, more activation memory; fine at CPU sizes.

In both, the loss of each micro-batch is divided by the number of micro-batches (gradient
accumulation = mean over micro-batches), and :class:`LogprobOutput` is computed on the last stage
from the final hidden states by the chunked output layer (see :mod:`sparrow_nemo.policy.logprobs`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.logprobs import TOP_K, LogprobOutput, policy_outputs
from sparrow_nemo.policy.model import PolicyModelSpec, unwrap_model

#: loss_fn(outputs, batch) -> (scalar loss for this micro-batch, metrics)
LossFn = Callable[[LogprobOutput, PolicyBatch], tuple[torch.Tensor, dict[str, float]]]


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _cpu_gpipe(
    model,
    spec: PolicyModelSpec,
    batches: list[PolicyBatch],
    loss_fn: LossFn | None,
    forward_only: bool,
    top_k: int,
) -> list[tuple[torch.Tensor, dict, LogprobOutput]]:
    """Plain torch pipeline (all forward, all backward); returns per-micro-batch results on the last stage."""
    from megatron.core import parallel_state as ps

    inner = unwrap_model(model)
    n = len(batches)
    dtype = inner.config.pipeline_dtype or torch.float32
    saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    results: list[tuple[torch.Tensor, dict, LogprobOutput]] = []
    for batch in batches:
        tokens, pos, mask = batch.model_inputs(multiple=spec.sequence_multiple)
        inp = None
        if not spec.pre_process:
            b, s = tokens.shape
            s //= spec.sequence_multiple  # sequence parallelism: this rank's share of the sequence
            inp = torch.empty((s, b, spec.shape.hidden_size), dtype=dtype)
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
        saved.append((inp, loss / n))
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
) -> list[tuple[torch.Tensor, dict, LogprobOutput]]:
    """megatron-core's schedule (GPU). Results per micro-batch on the last stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = _device()

    def loss_func(batch: PolicyBatch, hidden: torch.Tensor):
        lp = policy_outputs(model, hidden, batch, spec, top_k)
        loss, metrics = loss_fn(lp, batch) if loss_fn is not None else (hidden.sum() * 0.0, {})
        return loss, {"loss": loss.detach(), "metrics": metrics, "outputs": lp.detach()}

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
) -> list[tuple[torch.Tensor, dict, LogprobOutput]]:
    """Forward (+ backward unless ``forward_only``) of every micro-batch; gradients accumulate in the model.

    Micro-batches may differ in ``[B, S]`` (pipeline stages exchange shapes: ``variable_seq_lengths``).

    Returns:
        On the last pipeline stage, per micro-batch ``(loss, metrics, outputs)`` with ``outputs`` detached
        on CPU; on other stages an empty list.
    """
    if not batches:
        raise ValueError("run_microbatches needs at least one micro-batch")
    if not forward_only and loss_fn is None:
        raise ValueError("a training pass (forward_only=False) needs a loss_fn")
    run = _megatron_schedule if torch.cuda.is_available() else _cpu_gpipe
    return run(model, spec, batches, loss_fn, forward_only, top_k)


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
    model: torch.nn.Module, spec: PolicyModelSpec, batches: list[PolicyBatch], top_k: int = TOP_K
) -> list[LogprobOutput]:
    """Dense log-probs, entropy and top-k for each micro-batch, returned on every rank (CPU tensors)."""
    model.eval()
    results = run_microbatches(model, spec, batches, forward_only=True, top_k=top_k)
    return broadcast_from_last_stage(spec, [r[2] for r in results])
