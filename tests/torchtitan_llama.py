"""A tiny torchtitan (0.3) Llama 3 for the handoff tests; None when torchtitan is not installed, or does not import
with this torch (0.3.0 imports torch.distributed.fsdp.DataParallelMeshDims, which torch 2.11 lacks)."""

from __future__ import annotations

import importlib.util
import sys
import types
import warnings

import torch

# torchtitan 0.3.0 imports its MoE expert-parallel Triton kernels when any model is imported
# (models.common -> moe -> minimal_async_ep.kernels -> `import triton`), and CPU builds of
# torch have no triton. The dense Llama never calls them: a placeholder module lets the import
# through, and a call would raise.
_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_KERNEL_NAMES = ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
                 "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
                 "reduce_topk_slots_kernel", "topk_scores_grad_kernel")


def _unavailable(*args, **kwargs):
    raise RuntimeError("Triton kernels are not available in this CPU build")


def import_llama3():
    if importlib.util.find_spec("torchtitan") is None:
        return None
    if importlib.util.find_spec("triton") is None and _KERNELS not in sys.modules:
        kernels = types.ModuleType(_KERNELS)
        for name in _KERNEL_NAMES:
            setattr(kernels, name, _unavailable)
        sys.modules[_KERNELS] = kernels
    try:
        import torchtitan.models.llama3 as llama3
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    except ImportError as e:
        warnings.warn(f"torchtitan does not import with torch {torch.__version__}: {e}", stacklevel=2)
        return None

    return llama3, Llama3StateDictAdapter


DIM, LAYERS, HEADS, KV_HEADS, FFN, VOCAB, THETA = 64, 2, 4, 2, 160, 512, 10000.0


def tiny_llama3_config(rope: str = "complex"):
    """torchtitan's Llama3Model.Config for a 2-layer model with SDPA attention (CPU); `rope`:
    "complex" (ComplexRoPE, interleaved pairs, the default) or "cos_sin" (CosSinRoPE, halves)."""
    from torch import nn

    llama3, _ = import_llama3()
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    rope_cls = {"complex": ComplexRoPE, "cos_sin": CosSinRoPE}[rope]
    layers = llama3._build_llama3_layers(
        n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN,
        rope=rope_cls.Config(dim=DIM // HEADS, max_seq_len=256, theta=THETA, scaling="none"),
        fuse_qkv=True, attn_backend="flex")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()  # causal, no block masks
    return llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)),
        layers=layers)


def hf_config() -> dict:
    """The same model as a Hugging Face config.json (torchtitan's RMSNorm eps is 1e-5)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": DIM,
            "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "head_dim": DIM // HEADS, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": THETA},
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "dtype": "float32"}


def build(seed: int = 0, rope: str = "complex"):
    torch.manual_seed(seed)
    model = tiny_llama3_config(rope).build()
    model.init_states()
    with torch.no_grad():  # larger weights than the training init, so greedy tokens are not all alike
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
    return model
