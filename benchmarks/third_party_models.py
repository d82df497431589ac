"""The third-party models the fusion benchmark (and the experiments beside it) runs, random
weights: each one's description, how it is built with an example call, fresh inputs like the
example, and the modes as one-argument calls."""

from __future__ import annotations

from typing import Any

MODELS = {
    "vit_tiny": "timm vit_tiny_patch16_224, batch 1",
    "efficientnet_b0": "timm efficientnet_b0, batch 1",
    "convnext_atto": "timm convnext_atto, batch 1",
    "resnet50": "timm resnet50, batch 1",
    "gpt2": "HF GPT-2, 6 layers, width 384, 64 tokens, batch 1",
    "bert": "HF BERT encoder, 6 layers, width 384, batch 8 x 128 tokens",
    "mlp_item": "20-layer GELU MLP (256 wide) with a `.item()` decision, batch 8",
    "moe": "HF Mixtral-style MoE (2 layers, 8 experts top-2) forward, batch 4 x 16",
    "gru": "GRU policy (obs 32, hidden 256) stepping 64 times, 64 envs",
}


class GRUPolicy:
    """A recurrent policy stepped ``steps`` times in one call: observation, GRU cell, action head;
    returns the actions of every step."""

    def __init__(self, obs: int = 32, hidden: int = 256, actions: int = 8) -> None:
        import torch

        self.cell = torch.nn.GRUCell(obs, hidden).cuda()
        self.head = torch.nn.Linear(hidden, actions).cuda()

    def __call__(self, observations: Any, h: Any) -> Any:
        import torch

        actions = []
        for t in range(observations.shape[0]):
            h = self.cell(observations[t], h)
            actions.append(torch.tanh(self.head(h)))
        return torch.stack(actions)


def build(name: str) -> tuple[Any, tuple[Any, ...]]:
    """The model and its example arguments."""
    import torch

    torch.manual_seed(0)
    if name == "bert":
        from transformers import BertConfig, BertModel

        config = BertConfig(
            num_hidden_layers=6, hidden_size=384, num_attention_heads=6,
            intermediate_size=1536, vocab_size=30522,
        )  # fmt: skip
        model = BertModel(config).cuda().eval()
        return model, (torch.randint(0, 30522, (8, 128), device="cuda"),)
    if name == "mlp_item":
        from cudagraphs.tools.segment_workloads import DecisionMLP

        return DecisionMLP(256, 20).cuda().eval(), (torch.randn(8, 256, device="cuda"),)
    if name == "moe":
        import transformers

        config = transformers.MixtralConfig(
            vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=2,
            num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
            num_experts_per_tok=2, max_position_embeddings=256, use_cache=False,
        )  # fmt: skip
        model = transformers.MixtralForCausalLM(config).cuda().eval()
        return model, (torch.randint(0, 32000, (4, 16), device="cuda"),)
    if name == "gru":
        policy = GRUPolicy()
        return policy, (torch.randn(64, 64, 32, device="cuda"), torch.randn(64, 256, device="cuda"))
    if name == "gpt2":
        from transformers import GPT2Config, GPT2Model

        config = GPT2Config(n_layer=6, n_embd=384, n_head=6, vocab_size=50257, use_cache=False)
        model = GPT2Model(config).cuda().eval()
        return model, (torch.randint(0, 50257, (1, 64), device="cuda"),)
    import timm

    timm_name = {"vit_tiny": "vit_tiny_patch16_224"}.get(name, name)
    model = timm.create_model(timm_name, pretrained=False).cuda().eval()
    return model, (torch.randn(1, 3, 224, 224, device="cuda"),)


def fresh_like(example: tuple[Any, ...]) -> tuple[Any, ...]:
    """New random arguments shaped like the example: token ids within the vocabulary, floats
    from a normal distribution (never zeros)."""
    import torch

    return tuple(
        torch.randint_like(x, 0, 30000) if not x.is_floating_point() else torch.randn_like(x)
        for x in example
    )


def args_modes(calls: dict[str, Any]) -> dict[str, Any]:
    """Each mode as a one-argument call on a tuple of arguments (the timing's form)."""
    return {mode: (lambda c: lambda a: c(*a))(call) for mode, call in calls.items()}
