"""`torch-shift plan`: candidates, memory, recommendation and the CLI on the default model and on
config-only models (planning a 70B model needs no weights)."""

from __future__ import annotations

import json

import pytest

from torch_shift.cli import main
from torch_shift.models.toy import tiny_llama_config
from torch_shift.planner import ModelShape, get_profile
from torch_shift.planner.plan import POLICIES, Candidate, CandidateResult, candidates, parse_slo, pool_blocks, recommend

LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192)


def test_candidates_cover_every_family():
    found = candidates(8, thresholds=(64, 256))
    assert {c.policy for c in found} == set(POLICIES)
    assert [c.params for c in found if c.policy == "dp"] == [{"dp": 8, "tp": 1}, {"dp": 4, "tp": 2},
                                                              {"dp": 2, "tp": 4}]
    assert [c.params["threshold"] for c in found if c.policy == "shift"] == [64, 256]
    assert [c.policy for c in candidates(1)] == ["tp"]  # one device: nothing to choose
    with pytest.raises(ValueError, match="unknown policies"):
        candidates(2, ["tpp"])


def test_memory_per_candidate_by_hand():
    """Llama-3-70B in FP8 on an H200: DP-8 holds every weight on each rank, TP-8 an eighth; Seesaw a stage
    and a TP shard; the KV pool gets what is left of 90% of 141 GB, capped as the engine caps it."""
    from torch_shift.config import ModelConfig

    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **LLAMA_70B})
    shape, hw = ModelShape.from_config(config, dtype="fp8"), get_profile("h200x8")
    by_policy = {(c.policy, tuple(sorted(c.params.items()))): c for c in candidates(8, thresholds=(256,))}
    dp8 = by_policy[("dp", (("dp", 8), ("tp", 1)))]
    blocks, memory = pool_blocks(shape, hw, dp8, 16, 0.9, 256, 8192)
    assert memory["weight_bytes_per_rank"] == shape.num_parameters()  # fp8: one byte per parameter
    kv_token = 2 * 80 * 8 * 128 * 2  # bf16 KV, every KV head on the rank
    assert blocks == int((141e9 * 0.9 - shape.num_parameters()) // (kv_token * 16))
    tp8 = next(c for c in by_policy.values() if c.policy == "tp")
    _, tp_memory = pool_blocks(shape, hw, tp8, 16, 0.9, 256, 8192)
    assert tp_memory["weight_bytes_per_rank"] < shape.num_parameters() / 7
    seesaw = next(c for c in by_policy.values() if c.policy == "seesaw")
    _, seesaw_memory = pool_blocks(shape, hw, seesaw, 16, 0.9, 256, 8192)
    assert seesaw_memory["weight_bytes_per_rank"] > tp_memory["weight_bytes_per_rank"] * 1.9
    with pytest.raises(ValueError, match="do not fit"):
        pool_blocks(ModelShape.from_config(config, dtype="bf16"), get_profile("a10"), dp8, 16, 0.9, 256, 8192)


def test_on_cpu_ranks_seesaws_tier_comes_out_of_the_ranks_memory():
    """CPU ranks' memory is the host's: Seesaw's host tier shrinks their KV pools by its share per rank, and a
    tier that leaves no room is refused with the reason; beside GPUs the tier is host memory of its own."""
    from dataclasses import replace

    from torch_shift.config import ModelConfig
    from torch_shift.planner.plan import default_tier_gb

    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **LLAMA_70B, "num_hidden_layers": 2})
    shape, gpus = ModelShape.from_config(config, dtype="bf16"), get_profile("h200x8")
    cpus = replace(gpus, name="cpu ranks", num_devices=2, device_memory_bytes=12 * 2**30, host_link_bandwidth=None)
    assert not gpus.memory_is_host and cpus.memory_is_host
    assert default_tier_gb(gpus) == 64.0 and default_tier_gb(cpus) == 4.0
    assert default_tier_gb(replace(cpus, device_memory_bytes=2**30)) == 0.5  # a quarter of 2 GiB
    kv_block = 2 * 8 * 128 * 2 * 16  # K and V of a PP-2 stage (one layer), 8 KV heads of 128, bf16, 16 tokens

    def blocks(hw, tier_gb):
        seesaw = Candidate("seesaw", {"pp": 2, "cpu_kv_gb": tier_gb}, {"pp": 2, "policy": "seesaw"})
        return pool_blocks(shape, hw, seesaw, 16, 0.9, 4096, 8192)[0]

    assert blocks(gpus, 64.0) == blocks(gpus, 1.0)
    assert blocks(cpus, 1.0) - blocks(cpus, 4.0) == pytest.approx(1.5 * 2**30 / kv_block, abs=1)  # 3 GiB over 2 ranks
    with pytest.raises(ValueError, match="host KV tier of 64 GiB .* do not fit in 21.6 GiB"):
        blocks(cpus, 64.0)


def _result(policy, threshold=None, throughput=100.0, ttft=50.0, tpot=10.0):
    params = {"sp": 2, "tp": 1, "threshold": threshold} if policy == "shift" else {"tp": 2}
    metrics = {"num_requests": 4, "num_finished": 4, "throughput_tok_s": throughput, "ttft_p50_ms": ttft,
               "ttft_p90_ms": ttft * 2, "tpot_p90_ms": tpot, "e2e_p50_ms": 1.0}
    return CandidateResult(Candidate(policy, params, {}), metrics, {"weight_bytes_per_rank": 0,
                                                                     "kv_bytes_per_rank": 0})


def test_recommendation_under_an_slo_and_without():
    tp = _result("tp", throughput=120.0, ttft=400.0)
    fast = _result("shift", 64, throughput=100.0, ttft=40.0)
    slow = _result("shift", 1024, throughput=110.0, ttft=300.0)
    broken = CandidateResult(Candidate("pp", {"pp": 2}, {}), error="does not fit")
    assert recommend([tp, fast, slow, broken], {}).result is tp  # throughput first
    # an open-loop stream every candidate keeps up with: throughputs within 1% tie, the median TTFT decides
    level, quick = _result("dp", throughput=852.637, ttft=9.3), _result("tp", throughput=852.600, ttft=5.6)
    rec = recommend([level, quick], {})
    assert rec.result is quick and "ties within 1%" in rec.reason
    rec = recommend([tp, fast, slow, broken], parse_slo("ttft=200ms,tpot=0.05s"))
    assert rec.result is fast and rec.best_threshold == 64 and "meet" in rec.reason
    rec = recommend([tp, fast, slow], parse_slo("ttft=10ms"))  # nobody meets it: the smallest miss
    assert rec.result is fast and "no candidate meets" in rec.reason
    too_long = "max_model_len=7979 exceeds the model's max_position_embeddings=1024"
    failed = [CandidateResult(Candidate("tp", {"tp": 2}, {}), error=too_long),
              CandidateResult(Candidate("dp", {"dp": 2, "tp": 1}, {}), error=too_long), broken]
    with pytest.raises(ValueError) as info:  # one line per reason, naming the candidates it stopped
        recommend(failed, {})
    assert str(info.value) == (f"no candidate could serve the workload: {too_long} ({failed[0].candidate.label}, "
                               f"{failed[1].candidate.label}); does not fit ({broken.candidate.label})")
    assert parse_slo("ttft=1.5s") == {"ttft": 1500.0}
    for bad in ("ttft", "latency=5ms", "ttft=-1ms", "ttft=fast"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_plan_cli_on_the_default_model(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--hardware", "a10x2", "--synthetic", "64:16", "--rate", "50", "--num-requests", "40",
                 "--thresholds", "32,512", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "recommended:" in printed and "Shift SP2->TP2 @32" in printed
    report = json.loads(out.read_text())
    assert {c["policy"] for c in report["candidates"]} == set(POLICIES)
    for c in report["candidates"]:
        assert c.get("error") is None and c["num_finished"] == 40
        assert c["ttft_p50_ms"] > 0 and c["tpot_p50_ms"] > 0 and c["throughput_tok_s"] > 0
    assert report["recommended"]["label"] in {c["label"] for c in report["candidates"]}
    assert main(["plan", "--hardware", "a10x2"]) == 2  # no workload
    assert main(["plan", "--hardware", "a10x2", "--synthetic", "64", "--rate", "1"]) == 2
    assert main(["plan", "--hardware", "a10x2", "--synthetic", "64:16", "--thresholds", "x"]) == 2
    assert main(["plan", "--hardware", "a10x2", "--synthetic", "64:16", "--num-requests", "0"]) == 2
    assert main(["plan", "--hardware", "nope", "--synthetic", "64:16"]) == 2
    assert "unknown hardware" in capsys.readouterr().err


def test_plan_sweeps_flyings_split_load_and_never_splitting_serves_as_tp(tmp_path, capsys):
    """Flying at each `--dp-above`: a load that splits the TP group into DP replicas switches, and 'never' runs
    the same schedule as static TP-2 (the same simulated figures); the best of the sweep is recommended as the
    policy_config to give the engine."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--hardware", "a10x2", "--synthetic", "64:16", "--rate", "200", "--num-requests", "40",
                 "--policies", "tp,flying", "--dp-above", "1,never", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    by_label = {c["label"]: c for c in report["candidates"]}
    assert set(by_label) == {"TP2", "Flying DP2 (dp_above 1)", "Flying DP2 (never DP on load)"}
    tp, split, never = by_label["TP2"], by_label["Flying DP2 (dp_above 1)"], by_label["Flying DP2 (never DP on load)"]
    assert split["num_switches"] > 0 and never["num_switches"] == 0
    for key in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "throughput_tok_s"):
        assert never[key] == tp[key]
    assert never["params"] == {"dp": 2, "dp_above": None}
    chosen = report["recommended"]["flying_policy_config"]
    assert chosen in ({"dp_above": 1.0}, {"dp_above": None})
    assert f"--policy-config '{json.dumps(chosen)}'" in printed
    assert [c.params["dp_above"] for c in candidates(4, ["flying"], dp_above=(2.0, None))] == [2.0, None]
    for bad in ("x", "0.5", "inf", "nan", "4,"):
        assert main(["plan", "--hardware", "a10x2", "--synthetic", "64:16", "--dp-above", bad]) == 2
    assert "--dp-above takes a comma list" in capsys.readouterr().err


def test_plan_says_each_reason_a_candidate_cannot_run_once(capsys):
    """At world 3 the default model splits no way but DP and PP: one reason for the SP and Shift candidates, said
    once on the way and once in the table's notes."""
    assert main(["plan", "--hardware", "a10x2", "--world", "3", "--synthetic", "64:8", "--num-requests", "4",
                 "--policies", "dp,sp,shift", "--thresholds", "32,512"]) == 0
    captured = capsys.readouterr()
    reason = "layout SP3xTP1 does not fit"
    assert captured.err.count(reason) == 1 and captured.err.count("cannot run (as above)") == 2
    assert captured.out.count(reason) == 1
    rows = [line for line in captured.out.splitlines() if line.startswith(("SP3", "Shift"))]
    assert len(rows) == 3 and all(line.endswith("cannot run [1]") for line in rows)
    assert any(line.startswith("[1] " + reason) for line in captured.out.splitlines())
    assert "recommended: DP3: the only one of 4 candidates that served the whole workload" in captured.out


def test_plan_on_one_device_says_its_one_candidate_was_the_only_one_simulated(capsys):
    assert main(["plan", "--hardware", "h100", "--synthetic", "256:64", "--num-requests", "8", "--rate", "2"]) == 0
    assert "recommended: TP1: the only candidate simulated (" in capsys.readouterr().out


def test_plan_names_a_model_given_by_its_config_file_after_its_directory(tmp_path, capsys):
    from torch_shift.models.default import default_model_dir

    model = tmp_path / "Llama-X"
    model.mkdir()
    (model / "config.json").write_text((default_model_dir() / "config.json").read_text())
    assert main(["plan", "--model", str(model / "config.json"), "--hardware", "a10x2", "--synthetic", "64:8",
                 "--num-requests", "4", "--policies", "dp"]) == 0
    assert capsys.readouterr().out.startswith("model Llama-X on a10x2")


def test_plan_cli_clips_a_trace_to_the_models_context(capsys):
    """The shipped trace has requests beyond the default model's 1,024 tokens: said as such, with the flags that
    clip it (every candidate used to fail on a max_model_len the user never gave)."""
    from torch_shift.bench.traffic import DEFAULT_TRACE

    trace = ["plan", "--hardware", "a10x2", "--trace", str(DEFAULT_TRACE), "--num-requests", "20", "--policies", "tp"]
    assert main(trace) == 2
    err = capsys.readouterr().err
    assert "more than the model's context of 1024" in err and "--max-prompt" in err
    assert main(trace + ["--max-prompt", "512", "--max-output", "256"]) == 0
    assert "recommended: TP2" in capsys.readouterr().out


def test_plan_cli_on_a_config_only_70b_model(tmp_path, capsys):
    """Llama-3-70B in FP8 on 8 H200s, from a config.json alone: the paper-000 shape of Fig. 1 (Shift's
    TTFT below TP's, far below DP's) at 4k-token prompts."""
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama_config(**LLAMA_70B)))
    out = tmp_path / "plan.json"
    trace = tmp_path / "trace.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                     + "".join(f"{i * 0.5},{4096 - 7 * i},{250}\n" for i in range(24)))
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--hardware", "h200x8", "--dtype", "fp8",
                 "--trace", str(trace), "--policies", "dp,tp,shift", "--thresholds", "256", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    by_label = {c["label"]: c for c in report["candidates"]}
    shift, tp, dp = by_label["Shift SP8->TP8 @256"], by_label["TP8"], by_label["DP8"]
    assert shift["ttft_p50_ms"] < tp["ttft_p50_ms"] < dp["ttft_p50_ms"]
    assert report["world"] == 8 and "trace.csv" in report["workload"]
