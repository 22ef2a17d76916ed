"""The controller's callback face in a real ``lightning.Trainer`` (CPU, no logger, no checkpoints): a toy
LightningModule's ``training_step`` returns its loss and a StepReport whose bin 1 fails, and the schedule the
callback holds grows in that bin, step after step, up the ladder."""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo.control import STEP_REPORT, SparrowCallback, StepReport
from sparrow_nemo.control.calibration import CalibrationConfig
from sparrow_nemo.control.config import ControlConfig
from sparrow_nemo.control.tail_stats import BinTail
from sparrow_nemo.sparse.config import SparsityConfig
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

lightning = pytest.importorskip("lightning", reason="the dev extra installs lightning")
pl = lightning.pytorch

BIN = 100
START = BudgetSchedule(bin_tokens=BIN, budgets=(512, 768, 1024), name="start")


class ToyModule(pl.LightningModule):
    """A linear model on random data; each step reports bin 1 failing under the schedule the controller holds."""

    def __init__(self, control: SparrowCallback) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.control = control
        self.used: list[tuple[int, ...]] = []  # the schedule each step's "rollouts" used

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.layer(x).pow(2).mean()
        schedule = self.control.schedule
        self.used.append(schedule.budgets)
        tails = (BinTail(0, 400, 0.99, 0.98, 0.99), BinTail(1, 400, 0.70, 0.60, 0.80))
        report = StepReport(
            batch_idx, schedule, tails, 0.05, 2.0, reward_mean=1.0, response_length_mean=100.0
        )
        return {"loss": loss, STEP_REPORT: report}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(16, 4))
        return torch.utils.data.DataLoader(data, batch_size=4)


def test_a_lightning_trainer_drives_the_controller(tmp_path) -> None:
    sparsity = SparsityConfig(bin_tokens=BIN, page_size=16)
    control = ControlConfig(calibration=CalibrationConfig(candidate_budgets=(512, 768, 1024, 1536)))
    callback = SparrowCallback.from_config(sparsity, control, START, out_dir=tmp_path / "sparsity")
    assert isinstance(callback, pl.Callback)
    module = ToyModule(callback)
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=tmp_path,
    )
    trainer.fit(module)
    # bin 1 one rung up per step (later bins follow): 768 -> 1024 -> 1536 -> dense
    assert module.used == [(512, 768, 1024), (512, 1024, 1024), (512, 1536, 1536)]
    assert callback.schedule.budgets == (512, DENSE_BUDGET, DENSE_BUDGET)
    assert [h["actions"][0]["action"] for h in callback.history] == ["raise"] * 3
    assert callback.metrics["sparsity/raised_bins"] == 1.0 and callback.decision.schedule is callback.schedule
    assert (tmp_path / "sparsity" / "tail_history.png").is_file()  # on_train_end ran
    assert BudgetSchedule.from_yaml(tmp_path / "sparsity" / "schedule.yaml") == callback.schedule
