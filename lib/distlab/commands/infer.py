"""Before/after inference with an adapter (the enterprise LoRA demo's infer_before_after.py).

    python -m distlab infer --adapter build/runs/enterprise_7b/run_4gpu/model --prompts data/prompts/demo_prompts.jsonl

Loads the base model once, answers every prompt (before), wraps the same model with the LoRA adapter
(PEFT) and answers again (after). The enterprise assistant's generation settings by default: temperature 0.2, top-p 0.9,
seed 42 (re-seeded before every prompt), 220 new tokens; `--greedy` for exact determinism. The base is
`--model`, else the one the adapter was trained on (its adapter_config.json). Writes <out>/before.jsonl and
after.jsonl (replay files), before_after.md (prompt | before | after) and summary.json; when the prompt rows
carry `facts`, the key-fact accuracy before and after (distlab.keyfacts) is printed and written too.

The whole input (prompt rows, their facts, the adapter, the model name, the sampling settings) is checked
before the model loads; the outputs are written into <out>.partial/ and moved into <out> only when all of
them are, so a failed or interrupted run leaves no half-written folder. Nothing is downloaded unless
`--model` names a hub model (owner/name): otherwise the hub is offline (HF_HUB_OFFLINE=1), and an adapter
whose config names a hub model that is not in the local cache is refused, asking for --model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from distlab import keyfacts, markdown
from distlab.cli import UsageError, finite_float
from distlab.config import check_field, is_hub_id
from distlab.data import load_prompts
from distlab.generate import GENERATION_DEFAULTS, attach_adapter, generate, side_by_side
from distlab.jsonio import strict_json
from distlab.paths import BUILD_DIR

DEMO_GENERATION = {**GENERATION_DEFAULTS, "max_new_tokens": 220}  # the enterprise assistant's: 0.2 / 0.9 / 42 / 220


def adapter_base(adapter: Path) -> str | None:
    """The base model an adapter folder was trained on (None: not an adapter folder)."""
    config = adapter / "adapter_config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("base_model_name_or_path")


def _in_hub_cache(model: str) -> bool:
    from huggingface_hub import try_to_load_from_cache  # deferred: only an adapter naming a hub base asks

    return isinstance(try_to_load_from_cache(model, "config.json"), str)


def load_base(model: str | None):
    from distlab.models import load_model, load_tokenizer  # deferred: torch and transformers load slowly

    return load_model(model, attn_implementation="sdpa"), load_tokenizer(model)


def run(prompts_file: Path, adapter: Path | None, model: str | None, out: Path, greedy: bool, **sampling) -> dict:
    prompts = load_prompts(prompts_file)
    rows = [{"id": p.id, "facts": p.facts} for p in prompts]  # what keyfacts.score_rows reads of a prompt
    base, tokenizer = load_base(model)
    before = generate(base, tokenizer, prompts, greedy=greedy, out_path=out / "before.jsonl", label="before",
                      **sampling)
    summary = {"prompts": str(prompts_file), "model": model or "distlab-tiny", "adapter": str(adapter) if adapter
               else None, "generation": {**sampling, "greedy": greedy}, "before": keyfacts.score_rows(
                   rows, {r["id"]: r["response"] for r in before})}
    if adapter is not None:
        after = generate(attach_adapter(base, adapter), tokenizer, prompts, greedy=greedy,
                         out_path=out / "after.jsonl", label="after", **sampling)
        table = side_by_side(before, after)
        summary["after"] = keyfacts.score_rows(rows, {r["id"]: r["response"] for r in after})
        summary["changed"] = int((table["before"] != table["after"]).sum())
        summary["answers"] = len(table)
        (out / "before_after.md").write_text(_markdown(table, summary))
    (out / "summary.json").write_text(strict_json(summary, indent=2))
    return summary


def _markdown(table, summary: dict) -> str:
    lines = ["| id | prompt | before | after |", "|---|---|---|---|"]
    cell = markdown.cell  # prompts and answers are the model's text: escaped
    lines += [f"| {cell(r.id)} | {cell(r.prompt)} | {cell(r.before)} | {cell(r.after)} |" for r in table.itertuples()]
    lines += ["", f"{summary['changed']} of {summary['answers']} answers changed."]
    if summary["before"]["accuracy"] is not None:
        lines.append(f"Key-fact accuracy: before {summary['before']['accuracy']:.1%}, after "
                     f"{summary['after']['accuracy']:.1%} ({summary['before']['asked']} facts).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab infer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True, help="JSONL of prompts (rows may carry `facts`)")
    parser.add_argument("--adapter", help="LoRA adapter folder (a run's model/ folder); omit for the base only")
    parser.add_argument("--model", help="base model: folder, hub id or preset (default: the adapter's base)")
    parser.add_argument("--out", default=str(BUILD_DIR / "infer"), help="folder for the replay files and table")
    parser.add_argument("--max-new-tokens", type=int, default=DEMO_GENERATION["max_new_tokens"])
    parser.add_argument("--temperature", type=finite_float, default=DEMO_GENERATION["temperature"])
    parser.add_argument("--top-p", type=finite_float, default=DEMO_GENERATION["top_p"])
    parser.add_argument("--seed", type=int, default=DEMO_GENERATION["seed"])
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (ignores temperature and top-p)")
    args = parser.parse_args(argv)
    prompts = Path(args.prompts)
    if not prompts.is_file():
        raise FileNotFoundError(f"--prompts {prompts}: no such file")
    adapter = Path(args.adapter) if args.adapter else None
    if adapter is not None and adapter_base(adapter) is None:
        raise UsageError(f"--adapter {adapter}: " + ("no such folder" if not adapter.is_dir() else
                         "no adapter_config.json in this folder (expected a LoRA adapter, e.g. a run's model/)"))
    if not is_hub_id(args.model):
        # Set before transformers or huggingface_hub is imported (both read it once): a local folder, a preset
        # or an adapter's base must not turn into a download the user never asked for.
        os.environ["HF_HUB_OFFLINE"] = "1"
    model = args.model or (adapter_base(adapter) if adapter else None)
    model = check_field("model", model, "--model" if args.model else f"{adapter}/adapter_config.json")
    if not args.model and is_hub_id(model) and not _in_hub_cache(model):
        raise UsageError(f"{adapter}/adapter_config.json: its base {model!r} is a hub model that is not in the "
                         f"local cache, and nothing is downloaded unless you name one: pass --model {model} "
                         "(downloads it) or --model FOLDER (a local copy)")
    if args.max_new_tokens < 1 or not 0 < args.top_p <= 1 or args.temperature <= 0:
        raise UsageError("--max-new-tokens must be >= 1, --top-p in (0, 1], --temperature > 0")
    load_prompts(prompts)  # every row, its facts and its id checked before the model loads (cheap: no tokenizer)
    out = Path(args.out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a previous run's leftovers
    partial.mkdir(parents=True)
    try:
        summary = run(prompts, adapter, model, partial, args.greedy, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    except BaseException:  # Ctrl-C too: no half-written folder, whatever stopped the run
        shutil.rmtree(partial, ignore_errors=True)
        raise
    out.mkdir(parents=True, exist_ok=True)  # the user's folder: only our files are replaced in it
    for done in partial.iterdir():
        done.replace(out / done.name)
    partial.rmdir()
    for label in ("before", "after"):
        score = summary.get(label)
        if score and score["accuracy"] is not None:
            print(f"[infer] key-fact accuracy {label}: {score['accuracy']:.1%} ({score['found']}/{score['asked']})")
    if adapter is not None:
        print(f"[infer] {summary['changed']} of {summary['answers']} answers changed; table: {out / 'before_after.md'}")
    print(strict_json({"wrote": sorted(str(p) for p in out.iterdir())}))
    return 0
