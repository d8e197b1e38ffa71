"""The GPU knobs (fused AdamW, per-block compile) and the MFU ladder's rungs, checked on the CPU where they run too:
what each rung sets, where a rung's log goes and what its row says when it is killed, skipped or recompiles (the
training process faked), the every-token rows and the d20 preset's shape. The ladder's real training runs:
tests/launches/test_mfu_ladder_runs.py; the GPU session script's dry run (its bash -n and shellcheck are here):
tests/launches/test_gpu_session_dry_run.py."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from distlab.bench import mfu_ladder
from distlab.launch.process import RunResult
from distlab.models import NANOCHAT_D20_SHAPE, QWEN25_05B_SHAPE, load_model
from distlab.paths import REPO_ROOT
from distlab.strategies.base import Strategy, compile_layers


def test_fused_optimizer_is_one_fused_adamw_and_the_default_is_not():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert Strategy().make_optimizer(model, 1e-3, 0.01, fused=True).defaults["fused"] is True
    assert not Strategy().make_optimizer(model, 1e-3, 0.01).defaults["fused"]


@pytest.mark.slow  # torch.compile of the blocks: 3-5 s on two busy cores
def test_compile_layers_compiles_every_decoder_block_and_nothing_else():
    model = load_model(None)
    blocks = model.config.num_hidden_layers
    assert compile_layers(model) == blocks
    compiled = [m for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert len(compiled) == blocks and all(type(m).__name__.endswith("DecoderLayer") for m in compiled)


def settings(upto, **kw):
    return mfu_ladder.rung_settings(None, "cpu", "fp32", 64, 3, upto, **kw)


def test_each_rung_keeps_the_changes_above_it():
    first, last = settings(0), settings(len(mfu_ladder.RUNGS) - 1)
    assert first["dtype"] == "fp32" and first["attn_implementation"] == "eager" and not first["packing"]
    assert last["fused_optimizer"] and last["compile"] and last["packing"] and last["attn_implementation"] == "varlen"
    assert last["cross_entropy"] == "chunked" and last["micro_batch_size"] == 16
    assert last["dtype"] == "bf16" and last["master_weights"] is True
    assert "train_file" not in last and settings(0, train_file="rows.jsonl")["train_file"] == "rows.jsonl"


def test_the_reference_rung_is_the_old_best_and_the_new_rungs_add_one_change_each_in_the_checklists_order():
    ref = settings(mfu_ladder.REFERENCE_RUNG)
    # the old settings: the loss all at once, nothing compiled, packed rows with per-document attention
    assert ref["cross_entropy"] == "plain" and not ref.get("compile") and not ref.get("master_weights")
    assert ref["packing"] and ref["micro_batch_size"] == 8 and ref["fused_optimizer"] and ref["dtype"] == "fp32"
    changes = [mfu_ladder.RUNGS[i][1] for i in range(mfu_ladder.REFERENCE_RUNG + 1, len(mfu_ladder.RUNGS))]
    assert changes == [{"compile": True}, {"cross_entropy": "chunked"}, {"micro_batch_size": 16},
                       {"dtype": "bf16", "master_weights": True}]
    # tools/gpu_results.py reads old sessions' logs by rung name: the rungs they measured keep theirs
    assert [name for name, _ in mfu_ladder.RUNGS[:4]] == [
        "baseline: eager attention, padded rows, micro-batch 2", "+ fused AdamW", "+ SDPA attention",
        "+ micro-batch 8"]


@pytest.fixture
def no_peaks(monkeypatch):
    """The ladder without its matmul measurements (a second of CPU each)."""
    monkeypatch.setattr(mfu_ladder, "measure_matmul_flops", lambda *a, **k: 1e12)
    monkeypatch.setattr(mfu_ladder, "peak_flops", lambda *a, **k: (2e12, "test"))


def fake_training(monkeypatch, steps_logged: int, output: str, returncode: int = 0, timed_out: bool = False):
    """mfu_ladder.run replaced by a training process that logs `steps_logged` steps and prints `output`
    into the rung's folder, then ends as told. Returns the environments it was run with."""
    envs = []

    def run(cmd, *, timeout_s, log_path, env, **_):
        envs.append(env)
        out = log_path.parent
        records = [{"event": "start", "flops_per_token": 1e6, "executed_flops_per_token": 1e6, "peak_flops": 2e12,
                    "label_fraction": 0.5}]
        records += [{"event": "step", "step": s, "tokens_per_s": 1000.0, "tokens": 512, "peak_mem_bytes": 2**20,
                     "loss": 1.0} for s in range(1, steps_logged + 1)]
        (out / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        log_path.write_text(output)
        return RunResult(cmd, None if timed_out else returncode, timeout_s if timed_out else 1.0, log_path,
                         output.splitlines(), timed_out=timed_out)

    monkeypatch.setattr(mfu_ladder, "run", run)
    return envs


def test_a_killed_rung_keeps_its_log_and_its_row_says_after_which_step_it_stopped(tmp_path, monkeypatch, no_peaks):
    fake_training(monkeypatch, 7, "loading\nstep 7\n", timed_out=True)
    table = mfu_ladder.ladder(None, "cpu", "fp32", 64, steps=25, warmup=3, rungs=4, timeout_s=120, first=3,
                              out_dir=tmp_path)
    row = table.iloc[0]
    assert row["error"] == "killed at its 120-s box after step 7 of 25; log: rung3/stdout.log"
    assert (tmp_path / row["log"]).read_text() == "loading\nstep 7\n"
    assert (tmp_path / "rung3" / "train_log.jsonl").exists()
    # the 4 steps after the warm-up were measured before the kill, and count
    assert row["timed_steps"] == 4 and row["tokens_per_s"] == 1000 and row["tokens_per_step"] == 512
    assert row["mfu_data_sheet"] == pytest.approx(1000 * 1e6 / 2e12) and row["seq_len"] == 64


def test_a_rung_killed_before_its_first_step_says_what_it_printed_last(tmp_path, monkeypatch, no_peaks):
    fake_training(monkeypatch, 0, "[distlab] building the model\n", timed_out=True)
    row = mfu_ladder.ladder(None, "cpu", "fp32", 64, steps=25, warmup=3, rungs=1, timeout_s=60,
                            out_dir=tmp_path).iloc[0]
    assert row["error"] == ("killed at its 60-s box before step 1 of 25 (last output: [distlab] building the model); "
                            "log: rung0/stdout.log")
    assert pd_missing(row["tokens_per_s"])


def pd_missing(value) -> bool:
    return value != value  # NaN


def test_a_compiled_rung_runs_strict_and_a_recompile_is_its_error(tmp_path, monkeypatch, no_peaks):
    prefix = "V1129 20:28:44.941000 19048 torch/_dynamo/guards.py:5396] [0/1] [__recompiles] "  # torch 2.11's
    log = ("[distlab] single x1 on cpu\n"
           f"{prefix}Recompiling function forward in qwen2.py:200\n"
           f"{prefix}    triggered by the following guard failure(s):\n"
           f"{prefix}    - 0/0: tensor 'x' size mismatch at index 1. expected 512, actual 480\n"
           "Traceback (most recent call last):\n"
           "torch._dynamo.exc.RecompileError: Recompiling function forward in qwen2.py:200\n")
    envs = fake_training(monkeypatch, 1, log, returncode=1)
    compiled = mfu_ladder.REFERENCE_RUNG + 1
    table = mfu_ladder.ladder(None, "cpu", "fp32", 64, steps=25, warmup=3, rungs=compiled + 1,
                              first=mfu_ladder.REFERENCE_RUNG, out_dir=tmp_path)
    assert "DISTLAB_COMPILE_STRICT" not in envs[0] and "TORCH_LOGS" not in envs[0]
    assert envs[1]["DISTLAB_COMPILE_STRICT"] == "1" and envs[1]["TORCH_LOGS"] == "recompiles"
    row = table.iloc[1]
    assert row["error"] == ("Recompiling function forward in qwen2.py:200; - 0/0: tensor 'x' size mismatch at index 1. "
                            "expected 512, actual 480 (after step 1 of 25)")
    assert row["recompiles"] == 1 and pd_missing(table.iloc[0]["recompiles"])


def test_without_the_recompile_log_the_recompile_limit_line_names_it():
    log = ("W1129 20:28:59.218000 19114 torch/_dynamo/convert_frame.py:1994] [0/1] torch._dynamo hit "
           "config.recompile_limit (1)\n"
           "torch._dynamo.exc.FailOnRecompileLimitHit: Hard failure due to fail_on_recompile_limit_hit\n")
    assert mfu_ladder.recompile_reason(log) == "torch._dynamo hit config.recompile_limit (1)"
    assert mfu_ladder.recompile_reason("Traceback\nRuntimeError: CUDA error\n") == ""


def test_a_failed_rung_names_its_last_error_line_and_the_step_it_reached(tmp_path, monkeypatch, no_peaks):
    fake_training(monkeypatch, 0, "Traceback\ntorch.OutOfMemoryError: CUDA out of memory.\n", returncode=1)
    row = mfu_ladder.ladder(None, "cpu", "fp32", 64, rungs=1, out_dir=tmp_path).iloc[0]
    assert row["error"] == "torch.OutOfMemoryError: CUDA out of memory. (before step 1 of 30)"


def test_a_rung_that_dies_without_an_error_line_says_how_it_ended(tmp_path, monkeypatch, no_peaks):
    fake_training(monkeypatch, 2, "[distlab] single x1 on cpu\n", returncode=-9)  # the OOM killer's SIGKILL
    row = mfu_ladder.ladder(None, "cpu", "fp32", 64, rungs=1, out_dir=tmp_path).iloc[0]
    assert row["error"] == "exited with code -9 ([distlab] single x1 on cpu) (after step 2 of 30)"


def test_rungs_past_the_budget_are_skipped_with_a_row_saying_so(tmp_path, monkeypatch, no_peaks):
    monkeypatch.setattr(mfu_ladder, "run", lambda *a, **k: pytest.fail("a rung ran past the budget"))
    saved = []
    table = mfu_ladder.ladder(None, "cpu", "fp32", 64, rungs=2, timeout_s=90, budget_s=60, out_dir=tmp_path,
                              save=saved.append)
    assert list(table["rung"]) == [0, 1] and len(saved) == 2
    assert table["error"].str.fullmatch(r"skipped: its 90-s box is more than the \d+ s left of the ladder's "
                                        r"60-s budget").all(), table["error"].tolist()


def test_the_long_documents_fill_their_rows_and_labels_all_takes_every_token_as_a_target(tmp_path, tokenizer):
    from distlab.data import build_sft_data

    path = mfu_ladder.long_documents_file(tmp_path / "rows.jsonl", 256)
    replies = build_sft_data(path, tokenizer, 256)
    every = build_sft_data(path, tokenizer, 256, labels="all")
    assert len(every) == 32 and every.fill == 1.0  # each row one document filling its 256 tokens
    assert every.label_tokens == every.real_tokens - 32  # every token but each row's first (nothing precedes it)
    assert replies.label_tokens < every.label_tokens  # the prompt and the template's markup are targets too
    assert mfu_ladder.rung_settings(None, "cpu", "fp32", 64, 3, 0, str(path), "all")["labels"] == "all"


def test_the_d20_preset_is_nanochat_d20s_shape_at_its_parameter_count():
    shape = NANOCHAT_D20_SHAPE
    d, layers, vocab, ffn = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"], \
        shape["intermediate_size"]
    assert (d, layers, vocab, shape["num_attention_heads"], shape["head_dim"]) == (1280, 20, 65536, 10, 128)
    assert shape["num_key_value_heads"] == 10 and not shape["tie_word_embeddings"]
    # Qwen2's weights: q, k, v (with biases), o, the gated FFN and two norms a block; embedding, LM head, final norm
    params = layers * (4 * d * d + 3 * d + 3 * d * ffn + 2 * d) + 2 * vocab * d + d
    nanochat_d20 = layers * (4 * d * d + 2 * d * 4 * d) + 2 * vocab * d  # its FFN: two d x 4d matrices
    assert nanochat_d20 == pytest.approx(561e6, rel=1e-3) and params == pytest.approx(nanochat_d20, rel=0.01)
    assert ffn % 128 == 0 and QWEN25_05B_SHAPE["intermediate_size"] % 128 == 0


def test_a_preset_row_sets_model_row_length_and_labels_and_each_can_be_given_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(mfu_ladder, "ladder", lambda *a, **k: calls.append((a, k)) or mfu_ladder.pd.DataFrame(
        columns=list(mfu_ladder.COLUMNS)))
    mfu_ladder.main(["--preset-row", "d20"])
    mfu_ladder.main(["--preset-row", "d20", "--seq-len", "512", "--labels", "replies"])
    mfu_ladder.main([])
    (a, k), (a2, k2), (a3, k3) = calls
    assert (a[0], a[3], k["labels"]) == ("nanochat-d20-random", 2048, "all")
    assert (a2[0], a2[3], k2["labels"]) == ("nanochat-d20-random", 512, "replies")
    assert (a3[0], a3[3], k3["labels"]) == ("qwen2.5-0.5b-random", 1024, "replies")


def test_the_gpu_session_script_parses_and_passes_shellcheck():
    script = REPO_ROOT / "tools" / "gpu_session.sh"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (make debian installs it)")
    lint = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout
