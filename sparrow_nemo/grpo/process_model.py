"""What runs where in one RL step: every rank's engine, its share of the prompts, and the step's collectives.

The cluster process model (colocated, as NeMo-RL's and verl's colocated modes):

- Every rank (one per GPU) holds a policy shard and, with engine tensor parallelism ``k = 1`` (the default), a
  rollout engine of its own on the same GPU. With ``rollout.tensor_parallel_size = k > 1`` one engine spans
  ``k`` consecutive tensor-parallel ranks of one policy replica (:func:`engine_group`): each holds its shard and
  every rank of the engine makes each engine call with the same arguments (:meth:`RankPlan.engine_share`); the
  first of them (its *leader*) keeps the samples, the others drop their identical copies.
- The step's ``P`` prompts are split over the data-parallel ranks in contiguous blocks of whole prompts
  (``P / dp`` each, with all ``G`` samples of a prompt, so GRPO groups never cross ranks), and each replica's
  block is split again over its engines (``tp * pp / k`` per replica; the split may be uneven). An engine
  samples, scores the rewards and computes the group advantages of its prompts, where it generated them.
- Sample ``j * G + g`` (prompt ``j`` of the step, sample ``g``) is drawn from seed ``sample_seed(step seed,
  j * G + g)`` whichever engine draws it, so a run's samples do not depend on the layout.
- Samples cross ranks only inside their own model-parallel (TP x PP) group, as tensors (:func:`gather_samples`:
  two ``all_gather`` calls of flat int64 / float32 buffers after a 4-integer header), because every rank of a
  replica trains on the replica's share. Step statistics are all-reduced (:func:`reduce_sums` ...).
- Object collectives (run folder, evaluation dicts, checkpoint states: small, rare) go over a separate gloo
  group (:func:`object_group`), never over NCCL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparrow_nemo.rollout.engine import RolloutSample

#: finish reasons as integers for the sample exchange
FINISH_CODES: tuple[str, ...] = ("stop_token", "stop_string", "length")


def distributed() -> bool:
    """A multi-rank process group is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective_device() -> torch.device:
    """Where tensors of collectives live: the current GPU under NCCL, else the CPU (gloo)."""
    if distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_OBJECT_GROUP: Any = None


def object_group() -> Any:
    """A gloo group over the whole world for object collectives (created on first use; collective then).

    Under gloo the default group already is one; under NCCL a pickled object never goes over NCCL.
    """
    global _OBJECT_GROUP
    if not distributed() or dist.get_backend() == "gloo":
        return None
    if _OBJECT_GROUP is None:
        _OBJECT_GROUP = dist.new_group(backend="gloo")
    return _OBJECT_GROUP


def forget_object_group() -> None:
    """Drop the cached gloo group (the process group it belonged to was destroyed)."""
    global _OBJECT_GROUP
    _OBJECT_GROUP = None


def share(count: int, parts: int, index: int) -> range:
    """Part ``index`` of ``range(count)`` split into ``parts`` contiguous pieces, the first ``count % parts``
    one longer (some are empty when ``count < parts``)."""
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


@dataclass(frozen=True)
class RankPlan:
    """This rank's place in the step (all sizes in ranks).

    Attributes:
        rank, world: global rank and world size.
        tp_rank, tp, pp_rank, pp, dp_rank, dp: megatron's tensor / pipeline / data-parallel coordinates.
        engine_tp: GPUs per rollout engine (divides ``tp``).
    """

    rank: int = 0
    world: int = 1
    tp_rank: int = 0
    tp: int = 1
    pp_rank: int = 0
    pp: int = 1
    dp_rank: int = 0
    dp: int = 1
    engine_tp: int = 1

    def __post_init__(self) -> None:
        if self.tp % self.engine_tp:
            raise ValueError(
                f"rollout.tensor_parallel_size={self.engine_tp} does not divide the policy's tensor-parallel "
                f"size {self.tp}"
            )

    @classmethod
    def current(cls, engine_tp: int = 1) -> RankPlan:
        """The plan of this process from megatron's parallel state (a 1-rank plan without a process group)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return cls(engine_tp=engine_tp)
        return cls(
            rank=dist.get_rank(),
            world=dist.get_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
            dp=ps.get_data_parallel_world_size(),
            engine_tp=engine_tp,
        )

    @property
    def engines_per_replica(self) -> int:
        """Rollout engines in one data-parallel replica (``tp * pp / engine_tp``)."""
        return self.pp * self.tp // self.engine_tp

    @property
    def slot(self) -> int:
        """This rank's engine within its replica, ``0 .. engines_per_replica - 1`` (ranks of one engine share it)."""
        return self.pp_rank * (self.tp // self.engine_tp) + self.tp_rank // self.engine_tp

    @property
    def leads_engine(self) -> bool:
        """This rank keeps its engine's samples (scores their rewards, sends them to its replica); always true with
        ``engine_tp = 1``."""
        return self.tp_rank % self.engine_tp == 0

    @property
    def engine_index(self) -> int:
        """This rank's engine among all engines of the run (replica-major)."""
        return self.dp_rank * self.engines_per_replica + self.slot

    @property
    def num_engines(self) -> int:
        """Rollout engines of the run."""
        return self.dp * self.engines_per_replica

    def replica_prompts(self, num_prompts: int) -> range:
        """The step's prompts this rank's data-parallel replica trains on (contiguous, whole prompts)."""
        if num_prompts % self.dp:
            raise ValueError(
                f"grpo.prompts_per_step={num_prompts} does not split over {self.dp} data-parallel ranks "
                "(each rank trains on whole GRPO groups; use a multiple of the data-parallel size)"
            )
        per = num_prompts // self.dp
        return range(self.dp_rank * per, (self.dp_rank + 1) * per)

    def engine_share(self, num_prompts: int) -> range:
        """The step's prompts this rank's engine generates: its part of its replica's block (the same on every
        rank of a tensor-parallel engine, all of which make the call)."""
        block = self.replica_prompts(num_prompts)
        part = share(len(block), self.engines_per_replica, self.slot)
        return range(block.start + part.start, block.start + part.stop)

    def engine_prompts(self, num_prompts: int) -> range:
        """The step's prompts whose samples this rank keeps: its engine's share where it leads the engine, else
        none."""
        part = self.engine_share(num_prompts)
        return part if self.leads_engine else range(part.start, part.start)

    def eval_share(self, count: int) -> range:
        """This rank's engine's part of ``count`` evaluation prompts: every engine of the run takes a contiguous
        piece (the same on every rank of one engine)."""
        return share(count, self.num_engines, self.engine_index)

    def eval_items(self, count: int) -> range:
        """The evaluation prompts whose results this rank counts: its engine's share where it leads, else none."""
        return self.eval_share(count) if self.leads_engine else range(0, 0)

    @property
    def in_first_engine(self) -> bool:
        """This rank takes part in the run's first engine (rank 0's): the ranks that calibrate and probe with it."""
        return self.engine_index == 0


def engine_group(plan: RankPlan) -> Any:
    """The process group of this rank's tensor-parallel engine: ``plan.engine_tp`` consecutive ranks of its
    tensor-parallel group (megatron's TP group itself when they are all of it); None for ``engine_tp = 1``.

    Collective over the world (megatron's parallel state initialised): every rank creates every engine's group,
    in one order.
    """
    if plan.engine_tp == 1:
        return None
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    if plan.engine_tp == plan.tp:
        return tp_group
    every = {tuple(ranks) for ranks in gather_objects(dist.get_process_group_ranks(tp_group))}
    mine = None
    for ranks in sorted(every):
        for start in range(0, len(ranks), plan.engine_tp):
            members = list(ranks[start : start + plan.engine_tp])
            group = dist.new_group(members)
            if dist.get_rank() in members:
                mine = group
    return mine


# ----------------------------------------------------------------------------------------- samples
@dataclass
class SampleShare:
    """Samples as flat tensors (what crosses ranks), in sample order. n samples, Lp / Lr lengths.

    Attributes:
        prompt_lens, response_lens: [n] int64.
        finish: [n] int64 index into :data:`FINISH_CODES`.
        prompt_ids, response_ids: [sum Lp] / [sum Lr] int64, concatenated.
        kv_budget: [sum Lr] int64 KV budget (tokens) of each response token.
        logprobs: [sum Lr] float32 engine logprob of each response token.
        rewards, advantages: [n] float32.
    """

    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    finish: torch.Tensor
    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    kv_budget: torch.Tensor
    logprobs: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor

    @classmethod
    def from_samples(
        cls, samples: Sequence[RolloutSample], rewards: torch.Tensor, advantages: torch.Tensor
    ) -> SampleShare:
        """Flatten ``samples`` with their [n] rewards and advantages."""

        def cat(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
            return torch.cat(tensors).to(dtype) if tensors else torch.zeros(0, dtype=dtype)

        return cls(
            prompt_lens=torch.tensor([s.prompt_ids.numel() for s in samples], dtype=torch.int64),
            response_lens=torch.tensor([s.response_ids.numel() for s in samples], dtype=torch.int64),
            finish=torch.tensor([FINISH_CODES.index(s.finish_reason) for s in samples], dtype=torch.int64),
            prompt_ids=cat([s.prompt_ids for s in samples], torch.int64),
            response_ids=cat([s.response_ids for s in samples], torch.int64),
            kv_budget=cat([s.kv_budget for s in samples], torch.int64),
            logprobs=cat([s.logprobs for s in samples], torch.float32),
            rewards=rewards.to(torch.float32).reshape(-1),
            advantages=advantages.to(torch.float32).reshape(-1),
        )

    def __len__(self) -> int:
        return int(self.prompt_lens.numel())

    def _pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        ints = torch.cat(
            [
                self.prompt_lens,
                self.response_lens,
                self.finish,
                self.prompt_ids,
                self.response_ids,
                self.kv_budget,
            ]
        )
        floats = torch.cat([self.rewards, self.advantages, self.logprobs])
        return ints, floats

    @classmethod
    def _unpack(cls, n: int, ints: torch.Tensor, floats: torch.Tensor) -> SampleShare:
        lens_p, lens_r, finish = ints[:n], ints[n : 2 * n], ints[2 * n : 3 * n]
        tp, tr = int(lens_p.sum()), int(lens_r.sum())
        rest = ints[3 * n :]
        return cls(
            prompt_lens=lens_p,
            response_lens=lens_r,
            finish=finish,
            prompt_ids=rest[:tp],
            response_ids=rest[tp : tp + tr],
            kv_budget=rest[tp + tr : tp + 2 * tr],
            logprobs=floats[2 * n : 2 * n + tr],
            rewards=floats[:n],
            advantages=floats[n : 2 * n],
        )

    @classmethod
    def concat(cls, parts: Sequence[SampleShare]) -> SampleShare:
        """The parts one after the other."""
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in cls.__dataclass_fields__))

    def split_prompts(self) -> list[torch.Tensor]:
        """Per sample [Lp] int64."""
        return list(self.prompt_ids.split(self.prompt_lens.tolist()))

    def split_responses(self) -> list[torch.Tensor]:
        """Per sample [Lr] int64."""
        return list(self.response_ids.split(self.response_lens.tolist()))

    def split_kv_budget(self) -> list[torch.Tensor]:
        """Per sample [Lr] int64."""
        return list(self.kv_budget.split(self.response_lens.tolist()))

    def split_logprobs(self) -> list[torch.Tensor]:
        """Per sample [Lr] float32."""
        return list(self.logprobs.split(self.response_lens.tolist()))


def _all_gather_padded(
    tensor: torch.Tensor, sizes: list[int], group: Any, device: torch.device
) -> list[torch.Tensor]:
    """Every group member's 1-D ``tensor`` (their lengths in ``sizes``, group order). Collective."""
    width = max(sizes)
    padded = torch.zeros(width, dtype=tensor.dtype, device=device)
    padded[: tensor.numel()] = tensor.to(device)
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded, group=group)
    return [t[:n].cpu() for t, n in zip(out, sizes)]


def gather_samples(local: SampleShare, slot: int, group: Any) -> SampleShare:
    """The samples of every rank of ``group`` (the model-parallel group of a replica), ordered by engine slot.

    Collective over ``group``: a header all-gather ([samples, ints, floats, slot] per rank), then one all-gather
    each of the int64 and float32 buffers, padded to the longest. Ranks that generated nothing contribute
    empty buffers; ranks of one engine must not both contribute (only the leader has samples).
    """
    if group is None or dist.get_world_size(group) == 1:
        return local
    device = collective_device()
    ints, floats = local._pack()
    header = torch.tensor([len(local), ints.numel(), floats.numel(), slot], dtype=torch.int64, device=device)
    headers = [torch.empty_like(header) for _ in range(dist.get_world_size(group))]
    dist.all_gather(headers, header, group=group)
    meta = [h.tolist() for h in headers]
    all_ints = _all_gather_padded(ints, [m[1] for m in meta], group, device)
    all_floats = _all_gather_padded(floats, [m[2] for m in meta], group, device)
    parts = sorted(
        (m[3], SampleShare._unpack(m[0], i, f)) for m, i, f in zip(meta, all_ints, all_floats) if m[0] > 0
    )
    slots = [s for s, _ in parts]
    if len(set(slots)) != len(slots):
        raise RuntimeError(f"gather_samples: two ranks sent samples for one engine slot ({slots})")
    if not parts:
        return local
    return SampleShare.concat([p for _, p in parts])


# ----------------------------------------------------------------------------------------- statistics
def _reduce(values: Sequence[float], op: Any) -> list[float]:
    if not distributed():
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=op)
    return t.cpu().tolist()


def reduce_sums(values: Sequence[float]) -> list[float]:
    """Element-wise sums over all ranks (float64). Collective."""
    return _reduce(values, dist.ReduceOp.SUM)


def reduce_max(values: Sequence[float]) -> list[float]:
    """Element-wise maxima over all ranks. Collective."""
    return _reduce(values, dist.ReduceOp.MAX)


def replica_mean(metrics: dict[str, float]) -> dict[str, float]:
    """Per-replica loss metrics (each a mean over the replica's micro-batches, the same on its model-parallel
    ranks) over all data-parallel replicas: the mean, or for ``*_max`` / ``*_min`` the extreme. Equal
    micro-batch counts per replica make the mean the one-rank mean over all micro-batches. Collective."""
    keys = sorted(metrics)
    world = dist.get_world_size() if distributed() else 1
    sums = reduce_sums([float(metrics[k]) for k in keys])
    signs = [-1.0 if k.endswith("_min") else 1.0 for k in keys]
    extremes = reduce_max([s * float(metrics[k]) for s, k in zip(signs, keys)])
    return {
        k: s * e if k.endswith(("_max", "_min")) else total / world
        for k, total, s, e in zip(keys, sums, signs, extremes)
    }


def gather_scalars(value: float) -> list[float]:
    """``value`` of every rank, by global rank (a [world] all-gather). Collective."""
    if not distributed():
        return [float(value)]
    device = collective_device()
    mine = torch.tensor([float(value)], dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [float(t.item()) for t in out]


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every rank, by global rank (a small-object all-gather over the gloo group). Collective."""
    if not distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=object_group())
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` as global rank ``src`` has it, on every rank (over the gloo :func:`object_group`). Collective."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=object_group())
    return box[0]
