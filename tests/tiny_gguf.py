"""A tiny GGUF file written the way llama.cpp's converter writes a Llama model, for the GGUF tests.

`write_tiny_gguf(dir)` builds a byte-level BPE tokenizer (trained on a few sentences, with the chat
tokens of SmolLM2: `<|endoftext|>` 0, `<|im_start|>` 1, `<|im_end|>` 2) and a tied-embedding Llama of
a few thousand parameters, saves both as an ordinary model directory (`dir/hf`), and writes the same
model as `dir/tiny.gguf`: llama.cpp's tensor names, its q/k row permutation (the inverse of the one
transformers undoes on load), float32 tensors, and the tokenizer as GGUF metadata with bos 1,
eos 2, pad 2 and a ChatML template, as SmolLM2-135M-Instruct's file has them. No network.
Follows llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute, the llama tensor map) as of 2026-11.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
CORPUS = [
    "What is 2 + 3? The answer is 5.",
    "Solve the problem. Give the number only.",
    "user assistant system",
    "0 1 2 3 4 5 6 7 8 9 + - * = ?",
] * 4


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=SPECIAL[1], eos_token=SPECIAL[2], unk_token=SPECIAL[0], pad_token=SPECIAL[2]
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """(the GGUF file, the model directory holding the same weights and tokenizer)."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    hf_dir = root / "hf"
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)

    path = root / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    w.add_vocab_size(len(tok))
    w.add_tokenizer_model("gpt2")
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in SPECIAL else 1 for t, _ in vocab])  # 3: control, 1: normal
    import json

    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, tensor in model.state_dict().items():
        t = tensor.detach().float()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output tensor, and the loader ties it back
        else:
            _, _, i, rest = name.split(".", 3)
            part = rest.removesuffix(".weight")
            gname = f"blk.{i}.{names[part]}.weight"
            if part == "self_attn.q_proj":
                t = _permute(t, 4)
            elif part == "self_attn.k_proj":
                t = _permute(t, 2)
        w.add_tensor(gname, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, hf_dir
