#!/usr/bin/env python3
"""Writes the model-shape zoo: one JSON unit per model and unit kind, in the rfsdp-plan input
format, from each model's public config. Weights are bf16 (dtype_bytes 2); granule_rows is 1
here and set per experiment by bench_planner. Rerun after editing: python3 make_zoo.py"""
import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def t(name, shape, row_dims=1):
    return {"name": name, "shape": list(shape), "granule_rows": 1, "row_dims": row_dims, "dtype_bytes": 2}


def embed_head(vocab, hidden):
    return [t("embed_tokens.weight", [vocab, hidden]), t("norm.weight", [hidden]),
            t("lm_head.weight", [vocab, hidden])]


def llama_block(hidden, heads, kv_heads, head_dim, inter):
    return [
        t("input_layernorm.weight", [hidden]),
        t("self_attn.q_proj.weight", [heads * head_dim, hidden]),
        t("self_attn.k_proj.weight", [kv_heads * head_dim, hidden]),
        t("self_attn.v_proj.weight", [kv_heads * head_dim, hidden]),
        t("self_attn.o_proj.weight", [hidden, heads * head_dim]),
        t("post_attention_layernorm.weight", [hidden]),
        t("mlp.gate_proj.weight", [inter, hidden]),
        t("mlp.up_proj.weight", [inter, hidden]),
        t("mlp.down_proj.weight", [hidden, inter]),
    ]


def gpt_oss_block(hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=128, inter=2880):
    # Experts are fused 3-D tensors [E, H, I]: row_dims 2, a row is one of the E*H rows.
    q, kv = heads * head_dim, kv_heads * head_dim
    return [
        t("input_layernorm.weight", [hidden]),
        t("self_attn.q_proj.weight", [q, hidden]), t("self_attn.q_proj.bias", [q]),
        t("self_attn.k_proj.weight", [kv, hidden]), t("self_attn.k_proj.bias", [kv]),
        t("self_attn.v_proj.weight", [kv, hidden]), t("self_attn.v_proj.bias", [kv]),
        t("self_attn.o_proj.weight", [hidden, q]), t("self_attn.o_proj.bias", [hidden]),
        t("self_attn.sinks", [heads]),
        t("post_attention_layernorm.weight", [hidden]),
        t("mlp.router.weight", [experts, hidden]), t("mlp.router.bias", [experts]),
        t("mlp.experts.gate_up_proj", [experts, hidden, 2 * inter], row_dims=2),
        t("mlp.experts.gate_up_proj_bias", [experts, 2 * inter]),
        t("mlp.experts.down_proj", [experts, inter, hidden], row_dims=2),
        t("mlp.experts.down_proj_bias", [experts, hidden]),
    ]


def deepseek_v3_block(moe, hidden=7168, heads=128, q_lora=1536, kv_lora=512, rope=64, nope=128,
                      v_dim=128, experts=256, moe_inter=2048, dense_inter=18432):
    # Multi-head latent attention, then either the dense MLP (first 3 layers) or the MoE
    # (256 routed experts as separate tensors, 1 shared expert).
    out = [
        t("input_layernorm.weight", [hidden]),
        t("self_attn.q_a_proj.weight", [q_lora, hidden]),
        t("self_attn.q_a_layernorm.weight", [q_lora]),
        t("self_attn.q_b_proj.weight", [heads * (nope + rope), q_lora]),
        t("self_attn.kv_a_proj_with_mqa.weight", [kv_lora + rope, hidden]),
        t("self_attn.kv_a_layernorm.weight", [kv_lora]),
        t("self_attn.kv_b_proj.weight", [heads * (nope + v_dim), kv_lora]),
        t("self_attn.o_proj.weight", [hidden, heads * v_dim]),
        t("post_attention_layernorm.weight", [hidden]),
    ]
    if not moe:
        return out + [t("mlp.gate_proj.weight", [dense_inter, hidden]),
                      t("mlp.up_proj.weight", [dense_inter, hidden]),
                      t("mlp.down_proj.weight", [hidden, dense_inter])]
    out += [t("mlp.gate.weight", [experts, hidden]), t("mlp.gate.e_score_correction_bias", [experts])]
    for e in ["experts.%d" % i for i in range(experts)] + ["shared_experts"]:
        out += [t("mlp.%s.gate_proj.weight" % e, [moe_inter, hidden]),
                t("mlp.%s.up_proj.weight" % e, [moe_inter, hidden]),
                t("mlp.%s.down_proj.weight" % e, [hidden, moe_inter])]
    return out


def qwen3_moe_block(hidden, heads, kv_heads, head_dim, experts, moe_inter):
    out = [
        t("input_layernorm.weight", [hidden]),
        t("self_attn.q_proj.weight", [heads * head_dim, hidden]),
        t("self_attn.k_proj.weight", [kv_heads * head_dim, hidden]),
        t("self_attn.v_proj.weight", [kv_heads * head_dim, hidden]),
        t("self_attn.o_proj.weight", [hidden, heads * head_dim]),
        t("self_attn.q_norm.weight", [head_dim]),
        t("self_attn.k_norm.weight", [head_dim]),
        t("post_attention_layernorm.weight", [hidden]),
        t("mlp.gate.weight", [experts, hidden]),
    ]
    for i in range(experts):
        out += [t("mlp.experts.%d.gate_proj.weight" % i, [moe_inter, hidden]),
                t("mlp.experts.%d.up_proj.weight" % i, [moe_inter, hidden]),
                t("mlp.experts.%d.down_proj.weight" % i, [hidden, moe_inter])]
    return out


def mixtral_block(hidden=6144, heads=48, kv_heads=8, head_dim=128, experts=8, inter=16384):
    out = llama_block(hidden, heads, kv_heads, head_dim, inter)[:6]  # norms and attention
    out.append(t("block_sparse_moe.gate.weight", [experts, hidden]))
    for i in range(experts):
        out += [t("block_sparse_moe.experts.%d.w1.weight" % i, [inter, hidden]),
                t("block_sparse_moe.experts.%d.w2.weight" % i, [hidden, inter]),
                t("block_sparse_moe.experts.%d.w3.weight" % i, [inter, hidden])]
    return out


ZOO = {
    # Llama-3-8B: hidden 4096, 32 heads, 8 KV heads, head dim 128, FFN 14336, vocab 128256.
    "llama3_8b.block": llama_block(4096, 32, 8, 128, 14336),
    "llama3_8b.embed_head": embed_head(128256, 4096),
    # Llama-3-70B: hidden 8192, 64 heads, 8 KV heads, FFN 28672, vocab 128256.
    "llama3_70b.block": llama_block(8192, 64, 8, 128, 28672),
    "llama3_70b.embed_head": embed_head(128256, 8192),
    # GPT-OSS-120B: hidden 2880, 64 heads x 64, 8 KV heads, 128 experts of 2880, vocab 201088.
    "gpt_oss_120b.block": gpt_oss_block(),
    "gpt_oss_120b.embed_head": embed_head(201088, 2880),
    # DeepSeek-V3-671B: hidden 7168, MLA, 256 routed + 1 shared expert of 2048, vocab 129280.
    "deepseek_v3.moe_block": deepseek_v3_block(moe=True),
    "deepseek_v3.dense_block": deepseek_v3_block(moe=False),
    "deepseek_v3.embed_head": embed_head(129280, 7168),
    # Qwen3-30B-A3B: hidden 2048, 32 heads x 128, 4 KV heads, 128 experts of 768, vocab 151936.
    "qwen3_30b_a3b.block": qwen3_moe_block(2048, 32, 4, 128, 128, 768),
    "qwen3_30b_a3b.embed_head": embed_head(151936, 2048),
    # Mixtral-8x22B: hidden 6144, 48 heads x 128, 8 KV heads, 8 experts of 16384, vocab 32768.
    "mixtral_8x22b.block": mixtral_block(),
    "mixtral_8x22b.embed_head": embed_head(32768, 6144),
}

if __name__ == "__main__":
    for name, tensors in ZOO.items():
        with open(os.path.join(HERE, name + ".json"), "w") as f:
            f.write("[\n" + ",\n".join(json.dumps(x) for x in tensors) + "\n]\n")
        n = sum(math.prod(x["shape"]) for x in tensors)
        print("%-28s %5d tensors %8.3fB params" % (name, len(tensors), n / 1e9))
