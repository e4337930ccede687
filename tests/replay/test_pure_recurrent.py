"""A pure recurrent model (Mamba2: no attention, so no KV) replays with its whole budget in
checkpoints and a KV block pool that only names prefixes and never evicts; a hybrid with
shared attention blocks (Zamba2) replays from its own config.json too. Both through the CLI."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from hybridcache.cli import main
from hybridcache.errors import InvalidArgumentError
from hybridcache.policies import resolve_policy
from hybridcache.policies.eviction import MarconiState
from hybridcache.profiles import profile_from_config
from hybridcache.replay import Budget, RunConfig, split_budget
from hybridcache.replay.budgets import MIN_FREE_KV_TOKENS, free_kv_tokens

MAMBA2 = {"model_type": "mamba2", "hidden_size": 256, "num_hidden_layers": 8, "num_heads": 8, "head_dim": 64,
          "expand": 2, "state_size": 64, "n_groups": 1, "conv_kernel": 4, "dtype": "bfloat16"}
ZAMBA2 = {"model_type": "zamba2", "hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 8,
          "num_key_value_heads": 8, "n_mamba_heads": 8, "mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 2,
          "mamba_ngroups": 1, "intermediate_size": 1024, "adapter_rank": 16, "dtype": "bfloat16",
          "layers_block_type": ["mamba", "hybrid", "mamba", "mamba", "hybrid", "mamba"]}


def _config_json(tmp_path, name: str, config: dict) -> str:
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return str(path)


def _replay(tmp_path, config: dict, *budget: str, extra: tuple[str, ...] = ()) -> list[dict]:
    out = tmp_path / "r.json"
    rc = main(["replay", "--synthesize", "conversation", "--seed", "1", "--limit", "60",
               "--model", _config_json(tmp_path, config["model_type"], config), "--policy", "marconi,auto",
               *budget, *extra, "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("config", [MAMBA2, ZAMBA2], ids=["mamba2", "zamba2"])
def test_a_synthesized_conversation_replays_with_hits(tmp_path, config):
    records = _replay(tmp_path, config, "--cache-bytes", "200MB")
    assert [record["policy"].split(":")[0] for record in records] == ["marconi", "auto"]
    profile = profile_from_config(config)
    for record in records:
        assert 0 < record["token_hit_rate"] <= record["bound_token_hit_rate"]
        assert record["checkpoints_written"] > 0
        if profile.pure_recurrent:
            assert (record["kv_bytes"], record["state_bytes"]) == (0, 200 * 10**6)
            assert record["evictions"]["kv_blocks"] == 0  # the free pool only names prefixes


def test_a_pure_recurrent_model_replays_through_a_host_tier(tmp_path):
    records = _replay(tmp_path, MAMBA2, "--cache-bytes", "20MB", extra=("--host-bytes", "100MB"))
    assert all(record["token_hit_rate"] > 0 for record in records)


def test_separate_budgets_for_a_pure_recurrent_model_are_refused(tmp_path, capsys):
    rc = main(["replay", "--synthesize", "conversation", "--seed", "1", "--limit", "5",
               "--model", _config_json(tmp_path, "m", MAMBA2), "--kv-bytes", "1GB", "--state-bytes", "1GB"])
    assert rc == 2
    assert "no KV to budget" in capsys.readouterr().err


def test_the_free_kv_pool_covers_every_checkpoints_path_and_never_binds():
    profile, policy = profile_from_config(MAMBA2), resolve_policy("marconi")
    assert profile.kv_bytes_per_token == 0 and profile.state_tokens_equivalent == math.inf
    budget = split_budget(10**9, profile, policy, mean_prompt=3000.0)
    slots = 10**9 // profile.state_bytes
    assert (budget.kv_bytes, budget.state_bytes) == (0, 10**9)
    assert budget.free_kv_tokens == free_kv_tokens(slots, 3000.0) == (slots + 1) * 12_000
    geometry = RunConfig(profile, policy, budget).geometry
    assert geometry.checkpoint_slots == slots and geometry.kv_blocks == -(-budget.free_kv_tokens // 32)
    assert free_kv_tokens(0, 0.0) == MIN_FREE_KV_TOKENS
    with pytest.raises(InvalidArgumentError, match="no KV to budget"):
        RunConfig(profile, policy, Budget(0, 10**9))  # no combined budget sized its pool


def test_marconi_weighs_free_kv_blocks_by_the_flops_they_save():
    profile = profile_from_config(MAMBA2)
    state = MarconiState(profile, alpha=1.0)
    state.bind(SimpleNamespace(block_size=32))  # block_efficiency reads the block size alone
    assert state.block_efficiency(3) == profile.prefill_flops(64, 96) / 32
    assert math.isfinite(state.block_efficiency(1))


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1.0, "3000", None])
def test_a_bad_mean_prompt_is_refused_by_the_split(bad):
    with pytest.raises(InvalidArgumentError, match="mean_prompt"):
        split_budget(10**9, profile_from_config(MAMBA2), resolve_policy("auto"), bad)


def test_auto_saves_no_grid_when_kv_is_free(tmp_path):
    """Where a state outweighs any KV, ``auto`` saves branch points and turn ends only (not
    fitted to the free pool, whose size is a slack rule): no more checkpoints than requests
    make turns and branches, and a hit rate at least ``marconi``'s on this trace."""
    marconi, auto = _replay(tmp_path, MAMBA2, "--cache-bytes", "200MB")
    assert auto["admission"] == "auto"
    assert auto["checkpoints_written"] <= 2 * auto["requests"]
    assert auto["token_hit_rate"] >= marconi["token_hit_rate"]
