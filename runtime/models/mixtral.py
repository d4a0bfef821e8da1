"""Mixtral: Llama whose feed-forward is a mixture of experts, the top 2 of 8 per token with
their router weights renormalized; the checkpoint names experts w1 (gate), w3 (up), w2 (down)."""

import re

from pageserve.runtime.models.layers import CausalLM, SparseMoE

_EXPERT = re.compile(r"(.+)\.block_sparse_moe\.(gate|experts\.\d+\.w[123])\.weight")
_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(CausalLM):
    def mlp(self, cfg, layer):
        hf = cfg.hf_config
        return SparseMoE(cfg.hidden_size, hf["num_local_experts"], hf["num_experts_per_tok"],
                         cfg.intermediate_size, True, self.kernels, tp_size=cfg.tp_size)

    @staticmethod
    def rename(name):
        if m := _EXPERT.fullmatch(name):
            part = m.group(2)
            if part != "gate":
                part = part[:-2] + _PARTS[part[-2:]]
            return f"{m.group(1)}.mlp.{part}.weight"
        return name
