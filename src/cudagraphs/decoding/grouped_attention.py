"""One decode token's attention over grouped key/value heads, without copying the cache.

A model with grouped-query attention (Llama, Qwen, Mistral, Gemma, Phi-3: several query heads
share one key/value head) goes through transformers' SDPA attention. Under ``torch.compile``
that path expands every key/value head over its group of query heads (``repeat_kv``) before
the attention kernel: a copy of the whole attended cache, per layer and per token, which at
batch 16 costs more than the attention itself.

For a single query token there is an exact rewrite with no copy: the query heads of one group
become that key/value head's queries (``[batch, heads, 1, d]`` viewed as ``[batch, kv_heads,
group, d]``), attention runs on the cache as it is, and the output is viewed back. Every query
still attends to exactly the positions its mask allows (the mask is shared by the heads, or
viewed the same way when it is per head). transformers does the same in eager mode for one
token; this function does it under ``torch.compile`` too, and hands every other call
(prefill, dropout, a position bias, soft-capping) to transformers' own SDPA attention.

:func:`use_grouped_attention` switches a model whose attention is ``"sdpa"`` to this function,
through transformers' public registries (``AttentionInterface`` and ``AttentionMaskInterface``,
under :data:`GROUPED_SDPA`), and the Decoder does so before it compiles anything.

Right::

    why = use_grouped_attention(model)   # None: switched; else why not (the model is unchanged)
    decoder = Decoder(model, ...)        # the Decoder calls it itself (grouped_attention=True)

Wrong::

    model.config._attn_implementation = GROUPED_SDPA   # no mask function registered under it:
                                                        # transformers would build no mask
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from .attention import applies, computed_once, decode_attention

__all__ = [
    "GROUPED_KERNEL",
    "GROUPED_SDPA",
    "choose_attention",
    "grouped_kernel_attention",
    "grouped_sdpa_attention",
    "takes_sdpa_mask",
    "use_grouped_attention",
]

#: The name the function is registered under in transformers' attention registries.
GROUPED_SDPA = "cudagraphs_grouped_sdpa"
#: The same, with a short cache's one-token attention as one kernel (``decode_attention.py``).
GROUPED_KERNEL = "cudagraphs_grouped_kernel"


def _plain_softmax(dropout: float, kwargs: dict[str, Any]) -> bool:
    """Whether the call asks for plain softmax attention: no dropout, position bias or
    soft-capping, and no attention weights handed back."""
    return (
        dropout == 0.0
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[batch, heads, q, d]``, ``key``
    and ``value`` ``[batch, kv_heads, positions, d]``; returns ``([batch, q, heads, d], None)``.
    One query token with grouped heads is computed without ``repeat_kv``; anything else is
    transformers' SDPA attention, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, tokens, size = query.shape
    kv_heads = key.shape[1]
    mask = attention_mask
    plain = (
        tokens == 1
        and kv_heads < heads
        and heads % kv_heads == 0
        and _plain_softmax(dropout, kwargs)
        and key.shape[-1] == value.shape[-1]
        and (mask is None or (mask.dim() == 4 and mask.shape[1] in (1, heads)))
    )
    if not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )  # fmt: skip
    group = heads // kv_heads
    packed = query.reshape(batch, kv_heads, group, size)
    if mask is not None and mask.shape[1] == heads:  # one row per head: viewed like the query
        mask = mask.reshape(mask.shape[0], kv_heads, group, mask.shape[-1])
    # The group's queries attend side by side, not causally among themselves: each is its own
    # head's one token, with the positions the mask allows.
    out = F.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, scale=scaling, is_causal=False
    )
    return out.reshape(out.shape[0], heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def grouped_kernel_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """:func:`grouped_sdpa_attention`, except that one query token over a short cache runs as
    one kernel (``decode_attention.applies``). The choice reads the cache's length: under a
    compile whose shapes vary it would become a guard that splits the compiled step, so such
    a compile registers :data:`GROUPED_SDPA` instead (the Decoder does)."""
    if _plain_softmax(dropout, kwargs) and applies(query, key, value, attention_mask):
        return decode_attention(query, key, value, attention_mask, scaling).transpose(1, 2), None
    return grouped_sdpa_attention(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
        is_causal=is_causal, **kwargs,
    )  # fmt: skip


def _mask_computed_once(*args: Any, **kwargs: Any) -> Any:
    """transformers' SDPA mask, handed to every layer as one computed tensor under
    ``torch.compile``. Inductor otherwise recomputes the mask (a cheap pointwise) for each
    opaque operator that reads it: one more kernel per layer and token for the decode
    kernel."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if isinstance(mask, torch.Tensor) and torch.compiler.is_compiling():
        return computed_once(mask)
    return mask


def takes_sdpa_mask(model: Any) -> bool:
    """Whether ``model``'s attention takes SDPA's boolean mask as given: ``"sdpa"`` itself,
    :data:`GROUPED_SDPA` or :data:`GROUPED_KERNEL`, which hand it on unchanged."""
    implementation = getattr(model.config, "_attn_implementation", None)
    return implementation in ("sdpa", GROUPED_SDPA, GROUPED_KERNEL)


def choose_attention(model: Any, grouped: bool, kernel: bool) -> str:
    """Switch ``model`` to the grouped attention where ``grouped`` (with the one-kernel path
    where ``kernel``) and say which attention its decode steps run, for a decoder's stats."""
    from .attention import MAX_POSITIONS

    why = use_grouped_attention(model, kernel=kernel) if grouped else "grouped_attention=False"
    if why is not None:
        return f"the model's own: {why}"
    return f"grouped, one kernel up to {MAX_POSITIONS} cache positions" if kernel else "grouped"


def use_grouped_attention(model: Any, kernel: bool = True) -> str | None:
    """Switch ``model`` (a transformers model whose attention is ``"sdpa"``) to
    :func:`grouped_kernel_attention` (``kernel=False``: :func:`grouped_sdpa_attention`);
    ``None`` once switched (or already), else why not, with the model left as it was."""
    name, function = (
        (GROUPED_KERNEL, grouped_kernel_attention)
        if kernel
        else (GROUPED_SDPA, grouped_sdpa_attention)
    )
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation == name:
        return None
    if implementation in (GROUPED_SDPA, GROUPED_KERNEL):  # switched by another Decoder
        implementation = "sdpa"
        model.set_attn_implementation("sdpa")
    if implementation != "sdpa":
        return f"the model's attention is {implementation!r}, not 'sdpa'"
    if not callable(getattr(model, "set_attn_implementation", None)):
        return "this transformers has no set_attn_implementation"
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    # Registering a new name changes nothing for models that do not ask for it.
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, _mask_computed_once if kernel else sdpa_mask)
    try:
        model.set_attn_implementation(name)
    except (ValueError, KeyError, TypeError) as error:
        model.set_attn_implementation("sdpa")
        return f"transformers refused the attention function: {str(error).splitlines()[0]}"
    if model.config._attn_implementation != name:
        model.set_attn_implementation("sdpa")
        return "transformers kept the model's attention (set_attn_implementation did not apply)"
    return None
