"""`tether export`: a run's checkpoint as a Hugging Face model directory that `from_pretrained` loads.

OUT/ holds
    config.json, model*.safetensors   the checkpoint's weights and model config, copied byte for byte;
                                      for a LoRA run (model.lora), the adapter merged into its base
    tokenizer files                   the checkpoint's tokenizer
    generation_config.json            the run's sampling: temperature, top_p, max_new_tokens, eos ids
    README.md                         a model card: objective (resolved), model, data, reward, metrics
    tether_config.yaml                the run's config.yaml, to reproduce it
Every input is checked before anything is written, and OUT is written beside itself and renamed
into place, so a refused or failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import yaml

from ..records import checkpoint
from ..records.checkpoint import step_of
from ..model.loading import adapter_base as model_adapter_base, is_adapter_dir
from ..records.runlog import ACCURACY, accuracy, best, read_config, read_metrics, values
from ..objectives import display
from ..config.sections import EnvConfig, RewardConfig
from ..records.summary import reward_text
from ..schema import from_dict

WHICH = ("last", "best")  # besides a step number
TOKEN_HELP = "set HF_TOKEN=hf_... or log in once with `hf auth login` (`huggingface-cli login` in older versions)"


class ExportError(ValueError):
    """An export that cannot be done as asked; the message says why and what would work."""


def export(
    run_dir: str | Path,
    out: str | Path,
    step: str = "last",
    force: bool = False,
    push_to_hub: Optional[str] = None,
    log=print,
) -> Path:
    """Write the checkpoint `step` ("last", "best" or a step number) of RUN_DIR to OUT; push it to the
    Hub repo `push_to_hub` when given. Returns OUT."""
    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{run_dir} has no config.yaml; is it a tether run directory?")
    ckpt = select_checkpoint(run_dir, step, log=log)
    if is_adapter_dir(ckpt / "model"):
        adapter_base(ckpt / "model")  # peft and the base model are there, before anything is written
    _check_out(out, force)
    api = hub_api() if push_to_hub else None  # a missing token fails here, before anything is written
    cfg = read_config(run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would make OUT private
    try:
        _write(tmp, run_dir, ckpt, cfg)
        if out.exists():  # --force
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"exported {ckpt} to {out}")
    if api is not None:
        log(f"pushed to {upload(api, out, push_to_hub, ckpt)}")
    return out


def select_checkpoint(run_dir: Path, which: str, log=print) -> Path:
    """The checkpoint named by `which`: "last" (the newest good one), "best" (the best recorded
    held-out accuracy, `checkpoint.best`) or a step number; an ExportError lists what there is."""
    ckpts = checkpoint.list_checkpoints(run_dir)
    if not ckpts:
        raise ExportError(
            f"{run_dir} has no checkpoints (RUN_DIR/checkpoints/step_*); "
            f"a run writes one every trainer.save_every steps and at the end"
        )
    available = ", ".join(str(step_of(c)) for c in ckpts)
    if which == "last":
        ckpt = checkpoint.latest(run_dir, log=log)
    elif which == "best":
        ckpt = checkpoint.best(run_dir, log=log)
        if ckpt is None:
            raise ExportError(
                f"no checkpoint in {run_dir} has a recorded held-out accuracy; choose one with "
                f"--step N, from: {_with_accuracy(run_dir, ckpts)}"
            )
    else:
        try:
            n = int(which)
        except ValueError:
            raise ExportError(f"--step {which!r}: expected a step number, 'best' or 'last'") from None
        ckpt = next((c for c in ckpts if step_of(c) == n), None)
        if ckpt is None:
            raise ExportError(f"--step {n}: {run_dir} has no checkpoint of that step; available: {available}")
    if ckpt is None:
        raise ExportError(f"every checkpoint in {run_dir} is damaged (see the warnings above); available: {available}")
    problem = checkpoint.verify(ckpt)
    if problem:
        raise ExportError(f"checkpoint {ckpt} is damaged ({problem}); choose another with --step, from: {available}")
    return ckpt


def _with_accuracy(run_dir: Path, ckpts: list[Path]) -> str:
    """'50 (eval/accuracy 0.31), 60' : each step, with the accuracy metrics.jsonl logged at it."""
    evals = dict(accuracy(read_metrics(run_dir, missing_ok=True)))
    steps = [step_of(c) for c in ckpts]
    return ", ".join(f"{s}" + (f" ({ACCURACY} {evals[s]:.4g})" if s in evals else "") for s in steps)


def _check_out(out: Path, force: bool) -> None:
    if not out.exists():
        return
    if out.is_dir() and not any(out.iterdir()):
        return
    if not force:
        what = "a file" if not out.is_dir() else "a directory that is not empty"
        raise ExportError(f"{out} exists and is {what}; choose another OUT or pass --force to replace it")


# ---------------------------------------------------------------- what is written


def _write(dest: Path, run_dir: Path, ckpt: Path, cfg: dict) -> None:
    """The model directory (module docstring) into `dest`."""
    from transformers import AutoTokenizer

    src = ckpt / "model"
    lora = is_adapter_dir(src)
    if lora:
        _merge_adapter(src, dest)
    skip = {"generation_config.json", "README.md", "adapter_config.json", "adapter_model.safetensors"}
    for path in sorted(src.iterdir()):  # weights and config (full models), tokenizer files (both)
        if path.is_file() and path.name not in skip:
            shutil.copyfile(path, dest / path.name)
    tokenizer = AutoTokenizer.from_pretrained(src)
    generation_config(cfg, dest if lora else src, tokenizer).save_pretrained(dest)
    shutil.copyfile(run_dir / "config.yaml", dest / "tether_config.yaml")
    (dest / "README.md").write_text(model_card(run_dir, ckpt, cfg))


def adapter_base(adapter_dir: Path) -> str:
    """The base model a LoRA checkpoint's adapter was trained on (`model.loading.adapter_base`), checked to
    be loadable: peft installed, and a local base still there."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ExportError(f"{adapter_dir} holds a LoRA adapter; merging it needs peft: pip install peft") from None
    try:
        return model_adapter_base(adapter_dir)
    except (ValueError, FileNotFoundError) as err:
        raise ExportError(f"{err}; then export again") from None


def _merge_adapter(adapter_dir: Path, dest: Path) -> None:
    """The base model with the adapter's low-rank update added to its weights (peft merge_and_unload),
    saved in the base's dtype as safetensors."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(adapter_base(adapter_dir), dtype="auto", trust_remote_code=False)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(dest, safe_serialization=True)


def generation_config(cfg: dict, model_dir: Path, tokenizer) -> Any:
    """The run's sampling settings as a GenerationConfig: what `generate()` uses by default.

    eos: the ids tether's rollout stops on (hf engine: the tokenizer's eos and the model's). top_k is
    0 (off), as in tether's sampler; transformers' default of 50 would sample differently.
    stop_strings are left out: generate() needs the tokenizer passed to honour them, and fails
    without it; the model card lists them.
    """
    from transformers import GenerationConfig

    base = (
        GenerationConfig.from_pretrained(model_dir)
        if (model_dir / "generation_config.json").exists()
        else GenerationConfig()
    )
    rollout = cfg.get("rollout") or {}
    temperature = float(rollout.get("temperature", 1.0))
    eos = base.eos_token_id if isinstance(base.eos_token_id, list) else [base.eos_token_id]
    eos = sorted({i for i in [*eos, tokenizer.eos_token_id] if i is not None})
    settings = {
        "max_new_tokens": int(rollout.get("max_new_tokens", 64)),
        "eos_token_id": eos or None,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else base.pad_token_id,
        "bos_token_id": base.bos_token_id,
    }
    if temperature > 0:
        settings |= {
            "do_sample": True,
            "temperature": temperature,
            "top_p": float(rollout.get("top_p", 1.0)),
            "top_k": 0,
        }
    else:  # tether's temperature 0 is greedy decoding
        settings |= {"do_sample": False}
    return GenerationConfig(**settings)


def model_card(run_dir: Path, ckpt: Path, cfg: dict) -> str:
    """README.md: what the model is, how it was trained (resolved objective, data, reward,
    sampling) and what it scored (metrics.jsonl), with a snippet that loads it."""
    step = step_of(ckpt)
    model = (cfg.get("model") or {}).get("name_or_path", "?")
    obj = cfg.get("objective") or {}
    # The name the user chose (a preset's), with the objective it builds: `dapo (ppo_clip)`.
    name = (obj.get("label") or obj.get("name", obj)) if isinstance(obj, dict) else obj
    shown = display(obj)[0] if isinstance(obj, dict) else obj
    front = {"library_name": "transformers", "tags": ["tether", "rlvr", "reinforcement-learning", str(name)]}
    if _hub_id(model):
        front["base_model"] = model
    return "\n".join(
        [
            "---",
            yaml.safe_dump(front, sort_keys=False).strip(),
            "---",
            "",
            f"# {run_dir.name}, step {step}",
            "",
            f"A causal language model trained with reinforcement learning from verifiable rewards by "
            f"tether (objective **{shown}**), exported from `{ckpt}`.",
            "",
            *_training(cfg, step),
            "",
            "## Metrics",
            "",
            *_metrics(run_dir, ckpt),
            "",
            *_use(run_dir),
        ]
    )


def _training(cfg: dict, step: int) -> list[str]:
    """The card's "Training" section: base model, data, reward, budget, sampling and the resolved objective."""
    m = cfg.get("model") or {}
    data, rollout, trainer = cfg.get("data") or {}, cfg.get("rollout") or {}, cfg.get("trainer") or {}
    lora = f"; trained as a LoRA adapter ({_lora(cfg)}), merged into the base weights here" if m.get("lora") else ""
    args = f" with {data['task_args']}" if data.get("task_args") else ""
    stops = (
        f"; tether also stopped at the strings {rollout['stop_strings']} (pass `stop_strings=..., "
        f"tokenizer=tokenizer` to `generate` for the same)"
        if rollout.get("stop_strings")
        else ""
    )
    return [
        "## Training",
        "",
        f"- base model: `{m.get('name_or_path', '?')}`{lora}",
        f"- data: task `{data.get('task', '?')}`{args}; held-out accuracy on {data.get('eval_size', '?')} test "
        f"examples",
        f"- reward: {_reward(cfg.get('reward') or {}, data.get('task', ''), cfg.get('env') or {})}",
        f"- steps: this is step {step} of {trainer.get('total_steps', '?')}; "
        f"{rollout.get('prompts_per_step', '?')} prompts x {rollout.get('group_size', '?')} samples per step, "
        f"lr {trainer.get('lr', '?')}, seed {trainer.get('seed', '?')}",
        f"- sampling (also in generation_config.json): temperature {rollout.get('temperature')}, "
        f"top_p {rollout.get('top_p')}, max_new_tokens {rollout.get('max_new_tokens')}{stops}",
        "",
        "Objective, with every parameter resolved:",
        "",
        "```yaml",
        yaml.safe_dump({"objective": cfg.get("objective") or {}}, sort_keys=False).strip(),
        "```",
        "",
        "The whole config is in `tether_config.yaml`; `tether train tether_config.yaml output_dir=DIR` reruns it.",
    ]


def _use(run_dir: Path) -> list[str]:
    """The card's "Use" section: loading the exported model in plain transformers."""
    return [
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO")',
        'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO")',
        f'inputs = tokenizer({_example_prompt(run_dir)!r}, return_tensors="pt")',
        "out = model.generate(**inputs)  # samples with the run's settings (generation_config.json)",
        "print(tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True))",
        "```",
        "",
    ]


def _metrics(run_dir: Path, ckpt: Path) -> list[str]:
    """Start, end and best held-out accuracy and the exported step's, as markdown lines."""
    rows = read_metrics(run_dir, missing_ok=True)
    evals = accuracy(rows)
    step = step_of(ckpt)
    recorded = checkpoint.recorded_accuracy(ckpt)
    here = recorded if recorded is not None else dict(evals).get(step)
    if not evals:
        return ["No held-out evaluation was logged (metrics.jsonl has no eval/accuracy)."]
    top = best(evals)
    lines = [
        "| held-out accuracy | step | value |",
        "|---|---|---|",
        f"| start | {evals[0][0]} | {evals[0][1]:.4f} |",
        f"| end | {evals[-1][0]} | {evals[-1][1]:.4f} |",
        f"| best | {top[0]} | {top[1]:.4f} |",
        f"| **this model** | {step} | " + (f"{here:.4f} |" if here is not None else "not evaluated at this step |"),
    ]
    rewards = values(rows, "reward/mean")
    if rewards:
        lines += [
            "",
            f"Training reward (reward/mean): {rewards[0]:.4f} at the first step, "
            f"{rewards[-1]:.4f} at the last ({len(rewards)} steps logged).",
        ]
    return lines


def _lora(cfg: dict) -> str:
    lora = cfg["model"]["lora"]
    return ", ".join(f"{k} {v}" for k, v in lora.items() if k in ("r", "alpha", "dropout"))


def _reward(reward: dict, task: str, env: dict) -> str:
    """The reward as summary.md names it (`records.summary.reward_text`: `auto` is the task's own verifier)."""
    return reward_text(from_dict(RewardConfig, reward), task, from_dict(EnvConfig, env))


def _hub_id(name: str) -> bool:
    """A Hub repo id (org/name) rather than a local path: only those go in the card's base_model."""
    return name.count("/") == 1 and not os.path.exists(name) and not name.startswith((".", "/", "~"))


def _example_prompt(run_dir: Path) -> str:
    path = run_dir / "samples.jsonl"
    if path.exists():
        with path.open() as f:
            for line in f:
                try:
                    return json.loads(line)["prompt"]
                except (json.JSONDecodeError, KeyError):
                    continue
    return "Hello"


# ---------------------------------------------------------------- the Hub


def hub_api() -> Any:
    """An HfApi with the configured token; an ExportError naming what to do when there is none."""
    try:
        from huggingface_hub import HfApi, get_token
    except ImportError:
        raise ExportError("--push-to-hub needs huggingface_hub: pip install huggingface_hub") from None
    token = get_token()
    if not token:
        raise ExportError(f"--push-to-hub: no Hugging Face token is configured; {TOKEN_HELP}")
    return HfApi(token=token)


def upload(api: Any, folder: Path, repo: str, ckpt: Path) -> str:
    """Create the model repo if needed and upload `folder` as one commit; returns the commit's URL."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        api.create_repo(repo_id=repo, repo_type="model", exist_ok=True)
        info = api.upload_folder(
            folder_path=str(folder),
            repo_id=repo,
            repo_type="model",
            commit_message=f"tether export of {ckpt.parent.parent.name} step {step_of(ckpt)}",
        )
    except (HfHubHTTPError, OSError) as e:
        raise ExportError(
            f"uploading to {repo} failed ({e}); the export in {folder} is complete: retry with "
            f"`hf upload {repo} {folder}`"
        ) from e
    return str(getattr(info, "commit_url", info))
