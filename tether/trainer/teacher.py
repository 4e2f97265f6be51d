"""The teacher of on-policy distillation (`teacher` section, `objective.distill`): a frozen model that scores the
student's own samples once per rollout step, like the reference (docs/algorithms/distillation.md).

The teacher loads through the policy's own `load_model` (a directory, a tether run's checkpoint, a LoRA checkpoint
merged into its base, a hub id, a `.gguf` file, `tether:NAME`), in eval mode with every parameter frozen; it is
never given to the optimiser. Its passes run without gradient in micro-batches of `trainer.micro_batch_size`
rows through the same head as the reference's (`model.causal_lm.batched_topk`), at the sampling temperature: the
(N, T, V) logits of the batch never exist. It must read token ids as the student does: `vocabulary_problem`
compares the two tokenizers (their vocabularies, special tokens and the ids of a probe text) before a run writes
anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .. import objectives
from ..config.sections import TeacherConfig
from ..model.causal_lm import Tokens, batched_topk
from ..model.loading import check_model_loads, load_model, load_tokenizer
from ..schema import ConfigError
from .update import Policy, TeacherScores

PROBE = "The teacher reads 12 + 30 = 42 as the student does.\n\\boxed{42} ?!"
"""A text both tokenizers must encode to the same ids."""


@dataclass(frozen=True)
class Teacher:
    """The frozen teacher and how many top-k log-probs per position its passes return (0: the sampled tokens')."""

    model: Any
    topk: int = 0

    def scores(self, policy: Policy, tokens: Tokens) -> TeacherScores:
        """The teacher's log-probs of the batch's tokens (N, T), with its top-k at each counted position when asked,
        in micro-batches, under the run's precision and log-prob settings (temperature, fused head)."""
        with policy.precision():
            lp, top = batched_topk(self.model, tokens, policy.logprob_settings, self.topk)
        return TeacherScores(lp, *(top if top is not None else (None, None)))


def vocabulary_problem(student: Any, teacher: Any) -> str:
    """Why the teacher's tokenizer would read the student's token ids differently, or "" when it would not."""
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        only_s = sorted(set(s_vocab) - set(t_vocab))[:3]
        moved = sorted(k for k in set(s_vocab) & set(t_vocab) if s_vocab[k] != t_vocab[k])[:3]
        return (
            f"its vocabulary differs from the student's ({len(t_vocab)} tokens against {len(s_vocab)}; e.g. only the "
            f"student's: {only_s}, ids that differ: {moved})"
        )
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            return f"its {name} is {getattr(teacher, name, None)}, the student's {getattr(student, name, None)}"
    s_ids, t_ids = (tok(PROBE, add_special_tokens=False)["input_ids"] for tok in (student, teacher))
    if s_ids != t_ids:
        return f"it encodes {PROBE!r} to {t_ids[:8]}..., the student to {s_ids[:8]}..."
    return ""


def check_teacher(teacher: TeacherConfig, student_tokenizer: Any) -> None:
    """Before a run writes anything: the teacher's files can be read, and its tokenizer is the student's."""
    check_model_loads(teacher.name_or_path, key="teacher.name_or_path")
    try:
        tokenizer = load_tokenizer(teacher.name_or_path)
    except (OSError, ValueError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(
            f"teacher.name_or_path={teacher.name_or_path!r}: its tokenizer cannot be loaded ({first})"
        ) from None
    problem = vocabulary_problem(student_tokenizer, tokenizer)
    if problem:
        raise ConfigError(
            f"teacher.name_or_path={teacher.name_or_path!r} cannot teach this student: {problem}. Distillation "
            "compares the two models' log-probs of the same token ids, so the teacher must use the student's "
            "tokenizer: pick a teacher of the student's family (a checkpoint of a run of the same model.name_or_path, "
            "or a larger model sharing its tokenizer)"
        )


def load_teacher(cfg: TeacherConfig, obj: objectives.Objective, device, student: Any) -> Optional[Teacher]:
    """The frozen teacher on the policy's device (eval mode, no parameter requires a gradient), or None when the
    objective does not distill. A top-k signal also needs the two heads to score the same vocabulary."""
    if not obj.uses_teacher():
        return None
    model, _ = load_model(cfg.name_or_path, dtype=cfg.dtype, device=device)  # auto: by the device it runs on
    model.eval().requires_grad_(False)
    topk = obj.config.distill.topk if obj.config.uses_teacher_topk() else 0
    sizes = (_head_size(model), _head_size(student))
    if topk and sizes[0] != sizes[1]:
        raise ConfigError(
            f"teacher.name_or_path={cfg.name_or_path!r}: its output head scores {sizes[0]} tokens, the student's "
            f"{sizes[1]}; forward_kl_topk takes the student's log-probs at the teacher's top-k ids, which needs one "
            "vocabulary; use distill.signal reverse_kl or kl_loss (the sampled tokens only), or a teacher of that size"
        )
    return Teacher(model, topk)


def _head_size(model: Any) -> int:
    return model.get_output_embeddings().weight.shape[0]
