"""Chapter 06's plumbing: the KV-cache bytes (the formula against a real transformers cache, stage by stage),
the per-stage table, the planned jobs, the drawn pipeline and the width-ratio table; where the jobs run (Slurm
or the local launcher, chosen from the machine), the local launcher's tasks, records and failures; the timing
tables the chapter asserts on (the rounds' spread, the shared-core rows, one request's latency against its own
stages' forwards). A 2-stage job run by the local launcher for real: tests/launches/test_ch06_runs.py."""

from __future__ import annotations

import json
import time

import pandas as pd
import pytest
import torch

from distlab import provenance
from distlab.chapters import ch06
from distlab.layer_split import split_layers
from distlab.machine import Sections, example_machines
from distlab.slurm import local

MACHINES = example_machines()
LAPTOP, MAC, BOOK_VM = (MACHINES[k] for k in ("Linux laptop, 8 cores, normal user", "macOS laptop, 10 cores",
                                              "the book's build VM, 2 cores, root"))


def tiny_qwen2(kv_heads: int = 1):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=kv_heads, vocab_size=50)
    torch.manual_seed(0)
    return config, AutoModelForCausalLM.from_config(config).eval()


def test_cache_bytes_equal_the_formula_layer_by_layer():
    from transformers import DynamicCache

    for kv_heads in (1, 2, 4):
        config, model = tiny_qwen2(kv_heads)
        cache = DynamicCache(config=config)
        with torch.no_grad():
            model(torch.arange(7).unsqueeze(0), past_key_values=cache, use_cache=True)
        counted = ch06.cache_layer_bytes(cache, config.num_hidden_layers)
        assert counted == [ch06.kv_formula_bytes(config, 1, 7)] * 3
        assert ch06.kv_formula_bytes(config, 3, 7) == 2 * 3 * kv_heads * 8 * 7 * 4


def test_an_untouched_cache_layer_counts_zero():
    from transformers import DynamicCache

    config, _ = tiny_qwen2()
    assert ch06.cache_layer_bytes(DynamicCache(config=config), 3) == [0, 0, 0]


def test_kv_table_splits_the_counted_bytes_by_stage():
    config, _ = tiny_qwen2()
    per_layer = [ch06.kv_formula_bytes(config, 1, 10)] * 3
    table = ch06.kv_table(config, split_layers(3, 2), per_layer, 10)
    assert list(table["layers"]) == [2, 1]
    assert (table["formula (KiB)"] == table["measured (KiB)"]).all()
    assert table["measured (KiB)"].sum() * 1024 == sum(per_layer)


def test_plan_has_strong_weak_sweep_one_at_a_time_and_wide_jobs(tmp_path):
    plan = ch06.plan_jobs(["--max-new-tokens", "4"], tmp_path, "00:01:00", [1, 2, 3], 8, 4, 2, [1, 2], 2,
                          {512: tmp_path / "wide"}, ["--max-new-tokens", "2"])
    assert list(plan) == ["strong-s1", "strong-s2", "strong-s3", "weak-s1", "weak-s3", "sweep", "one-at-a-time",
                          "w512-s1", "w512-s2", "w512-s2-one"]
    assert plan["strong-s3"].ntasks == 3 and plan["strong-s3"].nodes == 2
    assert "--in-flight" in plan["one-at-a-time"].args and plan["sweep"].args[-1] == "1,2"
    assert plan["w512-s2"].model_dir == str(tmp_path / "wide") and plan["w512-s2"].args[:2] == ["--max-new-tokens", "2"]


def test_width_ratios_are_relative_to_one_stage():
    def run(tps):
        return {"summary": {"tokens_per_s": tps}}

    runs = {"strong-s1": run(100), "strong-s2": run(80), "one-at-a-time": run(50),
            "w512-s1": run(10), "w512-s2": run(18), "w512-s2-one": run(11)}
    table = ch06.width_ratios(runs, 256, [512])
    assert table.loc["256 (tiny base)", "2 stages, in flight"] == 0.8
    assert table.loc["512", "2 stages, in flight"] == 1.8
    assert isinstance(table, pd.DataFrame) and table.index.name == "width"


def test_the_drawn_pipeline_is_saved_with_provenance(tmp_path):
    config, _ = tiny_qwen2()
    stamp = provenance.stamp(model="tiny", world_size=2)
    out = ch06.draw_pipeline_kv(tmp_path / "kv.png", stamp, config)
    assert out.is_file() and out.stat().st_size > 10_000
    assert json.loads((tmp_path / "kv.png.provenance.json").read_text())["model"] == "tiny"


# ---------------------------------------------------------------- where the jobs run

def test_auto_runs_slurm_where_a_cluster_can_start_and_the_local_launcher_elsewhere(capsys):
    vm, mac = Sections(BOOK_VM), Sections(MAC)
    assert ch06.choose_scheduler("auto", vm) == "slurm"
    assert ch06.choose_scheduler("auto", mac) == "local"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("the jobs run under Slurm")
    assert lines[1].startswith(f"skipped: {ch06.CLUSTER_SECTION}: needs a local Slurm cluster")
    assert lines[2].startswith("the jobs run without Slurm") and len(lines) == 3
    assert vm.table() == [(ch06.CLUSTER_SECTION, "ran")] and mac.table()[0][1].startswith("skipped")


def test_local_can_be_forced_where_slurm_is_there_and_slurm_refused_where_it_is_not(capsys):
    vm = Sections(BOOK_VM)
    assert ch06.choose_scheduler("local", vm) == "local"
    assert "scheduler = 'local'" in vm.table()[0][1]
    with pytest.raises(ValueError, match="scheduler='slurm': this machine lacks a local Slurm cluster"):
        ch06.choose_scheduler("slurm", Sections(LAPTOP))
    with pytest.raises(ValueError, match="scheduler='kubernetes': one of 'auto', 'slurm', 'local'"):
        ch06.choose_scheduler("kubernetes", Sections(LAPTOP))


def test_job_ids_count_on_from_the_outputs_and_logs_found(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    assert local.next_job_id(out, logs) == 1
    (out / "7").mkdir(parents=True)
    (out / "stage-loss").mkdir()
    logs.mkdir()
    (logs / "stage-loss-12.out").write_text("")
    (logs / "strong-s2-9-rank1.log").write_text("")
    assert local.next_job_id(out, logs) == 13


def test_local_records_print_as_sacct_prints_them():
    rec = {"JobID": "3", "JobName": "strong-s2", "Partition": "local", "NNodes": "1", "NCPUS": "2",
           "NodeList": "laptop", "State": "COMPLETED", "ExitCode": "0:0", "Elapsed": "00:00:12",
           "Timelimit": "00:05:00"}
    lines = local.records_table([rec, {**rec, "JobID": "14", "State": "FAILED"}]).splitlines()
    assert lines[0].split() == list(local.TABLE_FIELDS) and set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split()[:2] == ["3", "strong-s2"] and lines[3].split()[6] == "FAILED"


def test_a_failed_task_is_named_and_stops_the_others(tmp_path, capsys):
    script = tmp_path / "run.sh"
    script.write_text('if [[ "$SLURM_PROCID" == 1 ]]; then echo "task $SLURM_PROCID"; kill -9 $$; fi\nsleep 30\n')
    start = time.monotonic()
    code = local.start_tasks(str(script), 2, str(tmp_path / "rank%t.log"))
    assert code == 137 and time.monotonic() - start < 10
    out = capsys.readouterr().out
    assert "error: task 1: Killed" in out and "task 0" not in out and "stopping the other tasks" in out
    assert (tmp_path / "rank1.log").read_text() == "task 1\n"


# ---------------------------------------------------------------- the timing tables

def fake_run(stage_events: list[list[tuple]], new_tokens: list[int], per_token_s: list[float],
             micro_batch: list[int], tokens_per_s: float = 1.0) -> dict:
    """A run as outputs.load_run gives it: each stage's events as (mb, step, start, end), the completions."""
    stages = [{"rank": r, "events": [{"mb": m, "step": k, "start": a, "end": b,
                                      "kind": "prefill" if k == 0 else "decode"} for m, k, a, b in evs]}
              for r, evs in enumerate(stage_events)]
    completions = pd.DataFrame({"new_tokens": new_tokens, "per_token_s": per_token_s, "micro_batch": micro_batch,
                                "ttft_s": [0.1] * len(new_tokens)})
    return {"stages": stages, "completions": completions,
            "summary": {"tokens_per_s": tokens_per_s, "wall_s": 1.0, "new_tokens": sum(new_tokens)}}


def test_one_request_alone_against_its_own_stages_forwards_over_the_same_steps():
    # micro-batch 0: prompt a (3 tokens: steps 1, 2), prompt b (2 tokens: step 1 only)
    s0 = [(0, 0, 0, 1), (0, 1, 2, 2.010), (0, 2, 3, 3.030)]
    s1 = [(0, 0, 1, 2), (0, 1, 2.1, 2.120), (0, 2, 3.1, 3.140), (0, 3, 4, 5)]  # step 3: no prompt's latency
    alone = fake_run([s0, s1], [3, 2], [0.05, 0.04], [0, 0])
    one = fake_run([[(0, 0, 0, 1), (0, 1, 1, 1.020), (0, 2, 2, 2.040)]], [3, 2], [0.03, 0.02], [0, 0])
    got = ch06.latency_alone({"one-at-a-time": alone, "strong-s1": one})
    # prompt a: stage 0 (10 + 30) / 2 = 20 ms, stage 1 (20 + 40) / 2 = 30 ms; prompt b: 10 and 20 ms
    assert got["stage 0 forward"] == pytest.approx(15) and got["stage 1 forward"] == pytest.approx(25)
    assert got["stage forwards, summed"] == pytest.approx(40) and got["per-token latency"] == pytest.approx(45)
    assert got["hand-offs"] == pytest.approx(5)
    assert got["1 stage, another job: forward of all layers"] == pytest.approx(25)


def test_round_rates_and_the_speedup_the_spread_allows():
    # one stage: rounds of 2 tokens, 0.1 s each (20 tokens/s); 2 stages: 0.08 s, 0.12 s, 0.08 s, 0.12 s
    def run(*round_s):
        ends = [1.0 + sum(round_s[:k]) for k in range(1, len(round_s) + 1)]
        last = [(0, 0, 0, 1.0)] + [(0, k, 0, end) for k, end in enumerate(ends, 1)]
        return fake_run([last], [5, 5], [0.1] * 2, [0, 0], tokens_per_s=2 * len(round_s) / sum(round_s))

    steady, noisy = run(0.1, 0.1, 0.1, 0.1), run(0.08, 0.12, 0.08, 0.12)
    assert list(ch06.round_rates(steady)) == pytest.approx([20.0] * 4)
    assert ch06.relative_error(steady) == pytest.approx(0)
    # per-token times 0.04, 0.06, 0.04, 0.06: standard deviation 0.011547, mean 0.05, 4 rounds
    assert ch06.relative_error(noisy) == pytest.approx(0.011547 / 0.05 / 2, rel=1e-4)
    runs = {"strong-s1": steady, "strong-s2": noisy, "sweep-b2": noisy}
    strong, _, _ = ch06.scaling_tables(runs, [1, 2], 2, 1, [2], cores=8)
    assert list(strong["ideal"]) == [1, 2] and strong["speedup"].iloc[1] == pytest.approx(1.0)
    assert strong["speedup_high"].iloc[1] == pytest.approx(1 + 2 * 0.11547, rel=1e-4)


@pytest.mark.parametrize("machine,stages,shared", [(BOOK_VM, [1, 2, 3], [2, 3]), (LAPTOP, [1, 2, 3], []),
                                                   (MACHINES["cloud VM, 1 core"], [1, 2], [2])])
def test_the_shared_core_claim_holds_only_where_stages_and_kernel_share_cores(machine, stages, shared, capsys):
    sections = Sections(machine)
    rows = ch06.shared_core_rows(pd.DataFrame({"stages": stages}), machine, sections)
    assert list(rows["stages"]) == shared
    printed = capsys.readouterr().out
    if shared:
        assert sections.table() == [(ch06.SHARED_CLAIM, "ran")] and printed == ""
    else:
        assert printed.startswith(f"skipped: {ch06.SHARED_CLAIM}: the stages and this kernel")
        assert printed.count("\n") == 1 and sections.table()[0][1].startswith("skipped")
