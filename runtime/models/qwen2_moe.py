"""Qwen2-MoE: Qwen2 whose feed-forward is a mixture of experts on every `decoder_sparse_step`-th
layer (except `mlp_only_layers`, which keep a dense MLP): the top k of the experts, weights
renormalized only with `norm_topk_prob`, plus a shared expert scaled by a sigmoid gate."""

from pageserve.runtime.models.layers import CausalLM, GatedMLP, SparseMoE


def num_experts(hf: dict) -> int:
    return hf.get("num_experts") or hf.get("num_local_experts") or 0  # the name moved in transformers 5


def is_sparse(hf: dict, layer: int) -> bool:
    return (layer not in (hf.get("mlp_only_layers") or []) and num_experts(hf) > 0
            and (layer + 1) % (hf.get("decoder_sparse_step") or 1) == 0)


class Qwen2MoeForCausalLM(CausalLM):
    def mlp(self, cfg, layer):
        hf = cfg.hf_config
        if not is_sparse(hf, layer):
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, self.kernels, cfg.tp_size)
        return SparseMoE(cfg.hidden_size, num_experts(hf), hf["num_experts_per_tok"],
                         hf["moe_intermediate_size"], hf.get("norm_topk_prob", False), self.kernels,
                         hf.get("shared_expert_intermediate_size", 0), cfg.tp_size)
