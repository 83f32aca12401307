#!/usr/bin/env python3
"""Writes a Hugging Face layout copy of a llama GGUF model: f16 model.safetensors (Q/K rows back in
HF's rotate-half order), config.json, tokenizer.json, tokenizer_config.json.

    pip install gguf numpy
    python3 scripts/export_hf.py [--gguf PATH] --out DIR

Weights are dequantised with the `gguf` package (independently of tandem's own code), so loading
the copy with tandem checks the HF loader, the f16 kernels and the rotate-half RoPE path against
the GGUF path.
"""
import argparse
import json
import os
import struct

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def default_gguf():
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "tandem", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def field(r, key):
    f = r.fields[key]
    if f.types and f.types[0].name == "ARRAY":
        return [bytes(f.parts[i]).decode() if f.types[-1].name == "STRING" else f.parts[i].tolist()[0] for i in f.data]
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0].name == "STRING" else v.tolist()[0]


def unpermute(w, n_head):
    """llama.cpp's converter interleaves each head's two halves (for its adjacent-pair RoPE);
    undo it: within every head, rows (0, 1, 2, 3, ...) hold pairs (i, i + d/2)."""
    rows, cols = w.shape
    hd = rows // n_head
    return w.reshape(n_head, hd // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, arr in tensors:
        b = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": "F16", "shape": list(arr.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=default_gguf())
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    r = GGUFReader(args.gguf)
    assert field(r, "general.architecture") == "llama", "only llama GGUFs"
    n_head = field(r, "llama.attention.head_count")
    n_kv = field(r, "llama.attention.head_count_kv")
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    per_layer = {
        "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    }
    tensors = []
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)]) if len(t.shape) > 1 else w.reshape(-1)
        if t.name.startswith("blk."):
            _, i, kind, _ = t.name.split(".")
            hf = f"model.layers.{i}.{per_layer[kind]}.weight"
            if kind == "attn_q":
                w = unpermute(w, n_head)
            elif kind == "attn_k":
                w = unpermute(w, n_kv)
        else:
            hf = names[t.name]
        tensors.append((hf, w.astype(np.float16)))
    os.makedirs(args.out, exist_ok=True)
    write_safetensors(os.path.join(args.out, "model.safetensors"), tensors)

    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    merges = field(r, "tokenizer.ggml.merges")
    bos, eos = tokens[field(r, "tokenizer.ggml.bos_token_id")], tokens[field(r, "tokenizer.ggml.eos_token_id")]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": field(r, "llama.embedding_length"),
        "intermediate_size": field(r, "llama.feed_forward_length"),
        "num_hidden_layers": field(r, "llama.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "max_position_embeddings": field(r, "llama.context_length"),
        "rms_norm_eps": field(r, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": field(r, "llama.rope.freq_base"),
        "vocab_size": len(tokens),
        "tie_word_embeddings": "output.weight" not in [t.name for t in r.tensors],
        "torch_dtype": "float16",
        "bos_token_id": field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(r, "tokenizer.ggml.eos_token_id"),
        "_name_or_path": field(r, "general.name") + " (HF export)",
    }
    assert field(r, "tokenizer.ggml.pre") == "smollm", "pre-tokenizer written below is smollm's"
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
            for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]},
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }
    tok_config = {
        "chat_template": field(r, "tokenizer.chat_template"),
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": False,
        "model_max_length": config["max_position_embeddings"],
    }
    for name, obj in [("config.json", config), ("tokenizer.json", tokenizer), ("tokenizer_config.json", tok_config)]:
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(obj, f, indent=1, ensure_ascii=False)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
