"""Types, ranges, choices and cross-field rules: every failure is one line naming key, value and source."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sparrow_nemo.config import ConfigError
from sparrow_nemo.grpo.losses import PolicyLossConfig
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.policy.optim import OptimizerSettings
from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.sparse.schedule import BudgetSchedule


def error_of(*overrides: str, recipe: str | Path | None = "tiny_cpu_short") -> str:
    """The ConfigError message for these overrides (fails the test when the config loads)."""
    with pytest.raises(ConfigError) as info:
        load_config(recipe, list(overrides))
    message = str(info.value)
    assert message.startswith("config error: ") and "\n" not in message
    return message


# ----- types ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "rollout.max_new_tokens=abc",
            "rollout.max_new_tokens=abc (from command line) - expected an integer",
        ),
        (
            "rollout.max_new_tokens=1.5",
            "rollout.max_new_tokens=1.5 (from command line) - expected an integer",
        ),
        (
            "rollout.max_new_tokens=true",
            "rollout.max_new_tokens=true (from command line) - expected an integer",
        ),
        ("sparsity.threshold=high", "sparsity.threshold=high (from command line) - expected a number"),
        ("sparsity.threshold=null", "sparsity.threshold=null (from command line) - expected a number"),
        ("control.calibrate=1", "control.calibrate=1 (from command line) - expected true or false"),
        (
            "rollout.stop_strings=stop",
            "rollout.stop_strings=stop (from command line) - expected a list of strings",
        ),
        ("rollout.stop_strings=[1]", "rollout.stop_strings.0=1 (from command line) - expected a string"),
        ("rollout.top_k=x", "rollout.top_k=x (from command line) - expected an integer"),
        (
            "policy.optimizer=3",
            "policy.optimizer=3 (from command line) - expected a mapping of OptimizerSettings keys",
        ),
        (
            "reward.options=[1]",
            "reward.options=[1] (from command line) - expected a mapping with string keys",
        ),
    ],
)
def test_wrong_type(override: str, expected: str) -> None:
    assert error_of(override) == "config error: " + expected


def test_float_fields_accept_ints_and_exponent_strings() -> None:
    # YAML 1.1 reads 1e-5 (no dot) as a string; a float field takes it as the number it spells
    config = load_config("tiny_cpu_short", ["policy.optimizer.lr=1e-5", "policy.optimizer.weight_decay=0"])
    assert config.policy.optimizer.lr == 1e-5 and isinstance(config.policy.optimizer.lr, float)
    assert config.policy.optimizer.weight_decay == 0.0 and isinstance(
        config.policy.optimizer.weight_decay, float
    )


# ----- ranges ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("sparsity.threshold=1.5", "expected a number in (0, 1)"),
        ("sparsity.threshold=0", "expected a number in (0, 1)"),
        ("sparsity.threshold=1", "expected a number in (0, 1)"),
        ("sparsity.quantile=-0.1", "expected a number in (0, 1)"),
        ("grpo.samples_per_prompt=1", "expected an integer >= 2"),
        ("grpo.loss.clip_low=-0.1", "expected a number in [0, 1)"),
        ("rollout.temperature=0", "expected a number > 0"),
        ("rollout.top_p=0", "expected a number in (0, 1]"),
        ("rollout.top_k=-1", "expected an integer >= 0"),
        ("rollout.stop_token_ids=[2, -1]", "expected a list of integers, each >= 0"),
        ("sparsity.page_size=0", "expected an integer >= 1"),
        ("data.max_bad_fraction=1.01", "expected a number in [0, 1]"),
        ("name=a/b", "expected a string of letters, digits, . _ -"),
    ],
)
def test_out_of_range(override: str, expected: str) -> None:
    message = error_of(override)
    key, value = override.split("=", 1)
    assert message == f"config error: {key}={value} (from command line) - {expected}"


@pytest.mark.parametrize(
    "override",
    [
        "sparsity.threshold=0.001",
        "sparsity.threshold=0.999",
        "grpo.samples_per_prompt=2",
        "rollout.top_p=1",
        "grpo.loss.clip_low=0",
        "data.max_bad_fraction=0",
        "rollout.top_k=0",
        "sparsity.sink_pages=0",
    ],
)
def test_range_boundaries_that_are_allowed(override: str) -> None:
    load_config("tiny_cpu_short", [override])


# ----- choices ---------------------------------------------------------------------------
def test_literal_choice_lists_the_options_and_suggests() -> None:
    assert error_of("rollout.backend=vllm") == (
        "config error: rollout.backend=vllm (from command line) - expected one of 'torch', 'trtllm'"
    )
    assert error_of("rollout.backend=reference") == (
        "config error: rollout.backend=reference (from command line) - expected one of 'torch', 'trtllm' "
        "('reference' was renamed 'torch')"
    )
    assert error_of("trainer.device=cuda:0").endswith(
        "expected one of 'auto', 'cpu', 'cuda' - did you mean 'cuda'?"
    )
    assert "did you mean 'raise_and_lower'?" in error_of("control.scheduler.adapt=raise_and_lowr")


def test_registry_names_come_from_the_grpo_registries() -> None:
    assert error_of("grpo.adv_estimator=grpoo") == (
        "config error: grpo.adv_estimator=grpoo (from command line) - expected a registered name (grpo, rloo)"
        " - did you mean 'grpo'?"
    )
    assert "icepop, mis, none, seq_mask, seq_mask_tis, tis" in error_of("grpo.loss.correction=is")
    assert "did you mean 'token_mean'?" in error_of("grpo.loss.aggregation=token-mean")
    assert "clipped_pg" in error_of("grpo.loss.name=ppo")
    assert (
        load_config(
            "tiny_cpu_short", ["grpo.adv_estimator=rloo", "grpo.loss.correction=icepop"]
        ).grpo.adv_estimator
        == "rloo"
    )


def test_loss_section_constructs_the_policy_loss_config() -> None:
    loss = load_config("base", ["grpo.loss.correction=seq_mask", "grpo.loss.kl_coef=0.01"]).grpo.loss
    built = PolicyLossConfig(**dataclasses.asdict(loss))
    assert dataclasses.asdict(built) == dataclasses.asdict(loss)


def test_optimizer_section_constructs_the_policy_optimizer_settings() -> None:
    optimizer = load_config(
        "tiny_cpu_short", ["policy.optimizer.betas=[0.8, 0.95]", "policy.optimizer.grad_clip=0"]
    ).policy.optimizer
    settings = OptimizerSettings(**dataclasses.asdict(optimizer))
    assert (settings.betas, settings.grad_clip, settings.lr) == ((0.8, 0.95), 0.0, 1e-3)
    assert error_of("policy.optimizer.betas=[0.9]").endswith("expected two numbers [beta1, beta2]")


def test_rollout_section_constructs_sampling_params() -> None:
    rollout = load_config(
        "tiny_cpu_short", ["rollout.top_k=5", "rollout.stop_token_ids=[2]", "rollout.stop_strings=[END]"]
    ).rollout
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    params = SamplingParams(**{name: getattr(rollout, name) for name in names})
    assert names <= {f.name for f in dataclasses.fields(rollout)}  # every sampling field has a recipe key
    assert (params.top_k, params.stop_token_ids, params.stop_strings) == (5, (2,), ("END",))
    assert (params.max_new_tokens, params.logprobs_topk) == (64, 20)


def test_distill_targets_are_hf_linear_names() -> None:
    assert error_of("distill.target_modules=[q_proj, k_prj]") == (
        "config error: distill.target_modules.1=k_prj (from command line) - expected one of 'q_proj', 'k_proj', "
        "'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj' - did you mean 'k_proj'?"
    )
    assert "each module named once" in error_of("distill.target_modules=[q_proj, q_proj]")


# ----- cross-field rules ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["grpo.loss.clip_high=0.1"],
            "grpo.loss.clip_high=0.1 (from command line) - expected >= clip_low (0.2)",
        ),
        (
            ["grpo.loss.icepop_high=0.4"],
            "grpo.loss.icepop_high=0.4 (from command line) - expected > icepop_low (0.5)",
        ),
        (
            ["policy.sequence_parallel=true"],
            "policy.sequence_parallel=true (from command line) - expected false unless tensor_model_parallel_size > 1",
        ),
        (
            ["policy.tensor_model_parallel_size=4"],
            "policy.tensor_model_parallel_size=4 (from command line) - expected a size that splits the model "
            "(tp=4 does not divide num_key_value_heads=2: each tensor-parallel rank holds whole KV heads (GQA "
            "groups are not split))",
        ),
        (
            ["policy.pipeline_model_parallel_size=3"],
            "policy.pipeline_model_parallel_size=3 (from command line) - expected a size that splits the model "
            "(pp=3 does not divide num_layers=4: each pipeline stage holds a whole number of layers)",
        ),
        (
            ["sparsity.dense_layers=5"],
            "sparsity.dense_layers=5 (from command line) - expected <= the model's 4 layers",
        ),
        (
            ["rollout.max_new_tokens=4000"],
            "rollout.max_new_tokens=4000 (from command line) - expected <= 3840 (data.max_prompt_tokens + "
            "rollout.max_new_tokens must fit the model's 4096 positions)",
        ),
        (
            ["rollout.backend=trtllm", "trainer.device=cpu"],
            "rollout.backend=trtllm (from command line) - expected torch when trainer.device=cpu (TensorRT-LLM "
            "needs CUDA)",
        ),
        (
            [
                "rollout.backend=trtllm",
                "policy.tensor_model_parallel_size=2",
                "rollout.tensor_parallel_size=2",
            ],
            "rollout.tensor_parallel_size=2 (from command line) - expected 1 with rollout.backend=trtllm (its engines "
            "run one per GPU; tensor-parallel engines are the torch backend's)",
        ),
        (
            ["distill.enabled=true", "sparsity.schedule=dense"],
            "distill.enabled=true (from command line) - expected false when the rollout schedule is dense (nothing "
            "to distill)",
        ),
        (
            ["distill.enabled=true", "distill.kl_coef=0", "distill.pg_coef=0"],
            "distill.kl_coef=0 (from command line) - expected > 0 or pg_coef > 0 (with both 0 the adapter never "
            "learns)",
        ),
    ],
)
def test_cross_field_rules(overrides: list[str], expected: str) -> None:
    assert error_of(*overrides) == "config error: " + expected


def test_non_synthetic_reward_needs_a_prompt_file() -> None:
    message = error_of("reward.type=math")
    assert message.startswith("config error: data.train_path=null (from ")
    assert "tiny_cpu_short.yaml) - expected a prompt file for reward.type=math" in message
    assert (
        load_config(
            "tiny_cpu_short",
            ["reward.type=math", "data.train_path=d/train.jsonl", "control.calibrate=false"],
        ).reward.type
        == "math"
    )
    assert "expected a file ending in .jsonl" in error_of("data.train_path=d/train.txt")


def test_callbacks_need_a_dotted_target() -> None:
    assert error_of("callbacks=[{window: 4}]").startswith(
        'config error: callbacks.0={"window": 4} (from command line) - expected a mapping with _target_'
    )
    assert error_of("callbacks=[{_target_: NoModule}]").startswith(
        'config error: callbacks.0={"_target_": "NoModule"} (from command line) - expected a mapping with _target_'
    )
    assert error_of("callbacks=[3]") == (
        "config error: callbacks.0=3 (from command line) - expected a mapping with string keys"
    )


# ----- model shape -----------------------------------------------------------------------
def test_shape_overrides_apply_over_the_preset() -> None:
    config = load_config(
        "tiny_cpu_short", ["++model.shape_overrides.num_layers=2", "++model.shape_overrides.head_dim=16"]
    )
    shape = config.model.shape()
    assert (shape.num_layers, shape.head_dim, shape.hidden_size) == (2, 16, 128)


def test_shape_override_errors() -> None:
    message = error_of("++model.shape_overrides.num_layerz=2")
    assert message.startswith(
        "config error: model.shape_overrides.num_layerz=2 (from command line) - expected a "
        "Qwen3Shape field (num_layers, hidden_size"
    )
    assert message.endswith("did you mean 'num_layers'?")
    assert error_of("++model.shape_overrides.num_layers=two") == (
        "config error: model.shape_overrides.num_layers=two (from command line) - expected an integer"
    )
    assert "Qwen3Shape.num_layers must be positive, got 0" in error_of("++model.shape_overrides.num_layers=0")
    assert "did you mean 'qwen3-1.7b'?" in error_of("model.preset=qwen3-1.7")
    assert "missing: num_layers, hidden_size" in error_of("model.preset=null")


def test_preset_null_with_a_full_shape() -> None:
    full = (
        "{num_layers: 2, hidden_size: 64, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, "
        "intermediate_size: 128, vocab_size: 96, tie_word_embeddings: false}"
    )
    config = load_config(
        "tiny_cpu_short", ["model.preset=null", f"++model.shape_overrides={full}", "sparsity.dense_layers=1"]
    )
    assert config.model.shape().num_layers == 2


# ----- schedule --------------------------------------------------------------------------
def test_schedule_specs_go_through_budget_schedule(tmp_path: Path) -> None:
    paper = load_config("base", ["sparsity.schedule=qwen3-4b-0.86"]).sparsity.build_schedule()
    assert paper == BudgetSchedule.from_preset("qwen3-4b-0.86")
    fixed = load_config(
        "tiny_cpu_short", ["sparsity.schedule=fixed:512"]
    ).sparsity.build_schedule()  # in the recipe's pages
    assert (fixed.budget(10**6), fixed.page_size, fixed.bin_tokens) == (512, 4, 16)
    assert load_config("tiny_cpu_short", ["sparsity.schedule=dense"]).sparsity.build_schedule().is_dense
    path = tmp_path / "sched.yaml"
    BudgetSchedule(bin_tokens=100, budgets=(64, 128), page_size=4, name="mine").to_yaml(path)
    from_file = load_config("tiny_cpu_short", [f"sparsity.schedule={path}"]).sparsity.build_schedule()
    assert from_file == BudgetSchedule(bin_tokens=100, budgets=(64, 128), page_size=4, name="mine")


def test_bad_schedule_specs() -> None:
    message = error_of("sparsity.schedule=qwen3-1.7b-0.87")
    assert message.startswith(
        "config error: sparsity.schedule=qwen3-1.7b-0.87 (from command line) - expected a "
        "valid schedule (unknown schedule preset 'qwen3-1.7b-0.87'; known presets: "
    )
    assert "schedule file nowhere.yaml not found" in error_of("sparsity.schedule=nowhere.yaml")
    assert "must be a positive multiple of page_size=4" in error_of("sparsity.budgets=[64, 102]")
    assert "non-decreasing" in error_of("sparsity.budgets=[128, 64]")
    assert "a non-empty list of budgets" in error_of("sparsity.budgets=null")
    assert error_of("sparsity.page_size=32", "sparsity.schedule=qwen3-1.7b-0.86").startswith(
        "config error: sparsity.page_size=32 (from command line) - expected the page size of schedule"
    )
    assert "expected budgets >= 12 tokens (the sink + local pages)" in error_of("sparsity.schedule=fixed:8")


def test_calibration_candidates_rules() -> None:
    assert "strictly increasing" in error_of("control.calibration.candidate_budgets=[64, 64]")
    assert "multiples of sparsity.page_size=4 that are >= 12 tokens, but got 18" in error_of(
        "control.calibration.candidate_budgets=[16, 18]"
    )
    assert "but got 8" in error_of("control.calibration.candidate_budgets=[8, 16]")
    assert "at least one candidate" in error_of("control.calibration.candidate_budgets=[]")


def test_sparsity_and_control_sections_configure_the_scheduler() -> None:
    from sparrow_nemo.control import SparrowCallback

    config = load_config(
        "tiny_cpu_short", ["control.scheduler.adapt=raise_and_lower", "sparsity.noise_z=1.5"]
    )
    start = config.sparsity.build_schedule()
    scheduler = SparrowCallback.from_config(config.sparsity, config.control, start).scheduler
    assert (scheduler.config.adapt, scheduler.threshold, scheduler.noise_z) == ("raise_and_lower", 0.86, 1.5)
    assert scheduler.candidates == tuple(config.control.calibration.candidate_budgets)


def test_default_distill_targets_are_every_decoder_linear() -> None:
    from sparrow_nemo.hf_qwen3 import ATTN_LINEARS, MLP_LINEARS

    assert load_config("tiny_cpu_short").distill.target_modules == ATTN_LINEARS + MLP_LINEARS
