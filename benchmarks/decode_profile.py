"""Where a decode step's time goes: the kernels of ``Decoder(compile=...)`` at batch 1.

One warm request, then a profiled one (``torch.profiler``, CUDA activity: the kernels a graph
replay launches are recorded one by one). Reports kernels per token, GPU kernel time per token
against the wall time per token (the gap is time the GPU waits), the share of the
weight-streaming roofline (every weight read once per token at the HBM bandwidth), kernel time
per token by class (products, attention, Inductor's fused kernels, copies, other), and the ten
kernels that cost the most per token. ``--variants`` profiles the Decoder with its projections
unfused (``fuse=False``), with the model's own attention (``expanded``: ``grouped_attention=
False``), with the grouped attention through SDPA (``grouped-sdpa``: ``attention_kernel=False``)
and as it comes (``fused``) in one run, each on a fresh model of the same seed.

    python benchmarks/decode_profile.py --model llama-2048 --max-length 168
    python benchmarks/decode_profile.py --model llama-2048 --compile max-autotune-no-cudagraphs
    python benchmarks/decode_profile.py --model llama-2048 --compile coordinate-descent
    python benchmarks/decode_profile.py --model llama-2048 --sdpa flash
    python benchmarks/decode_profile.py --variants unfused,expanded,fused
    python benchmarks/decode_profile.py --option triton.enable_pdl=True
    python benchmarks/decode_profile.py --products cublas
    python benchmarks/decode_profile.py --attention gqa

``--sdpa`` picks scaled-dot-product attention's kernel (``torch.nn.attention.sdpa_kernel``) for
the construction (compile and captures) and every request; ``default`` leaves PyTorch's choice.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from common import RESULTS, at_bandwidth, memory_bandwidth, weight_bytes, write
from decode_modes import COORDINATE_DESCENT
from rich.console import Console

#: Kernel classes by name, the first match wins (CUPTI's kernel names; on a CPU smoke run the
#: operators' names, which mostly fall in "other"). Inductor's kernels first: their names hold
#: the operators they were fused around ("..._rows_linear_rsqrt_8" is a norm, not a product).
KERNEL_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fused (Inductor)", ("triton_",)),
    # "attend": the library's one-token attention kernel (decoding/attention.py).
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient_attention", "attend")),
    ("products", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "splitk", "aten::mm",
                  "aten::addmm", "aten::linear", "rows_linear", "one_row_product")),
    ("copies", ("copy", "memcpy", "memset", "fill")),
)  # fmt: skip


#: ``--products``: who computes the one-row products, as the report's header line names it.
PRODUCTS = {
    "default": "every one-row product on the Triton kernel",
    "cublas": "cuBLAS's products (the model fused by fuse_projections(model) first)",
}


def kernel_class(name: str) -> str:
    lowered = name.lower()
    return next((c for c, keys in KERNEL_CLASSES if any(k in lowered for k in keys)), "other")


def profile(
    args: argparse.Namespace, fuse: bool = True, grouped: bool = True, kernel: bool = True
) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from cudagraphs.decoding.decoder import Decoder
    from cudagraphs.tools.workloads import random_llama

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = random_llama(args.model, device, getattr(torch, args.dtype))
    if args.attention == "gqa":
        use_gqa_attention(model)
    elif args.attention != "sdpa":  # transformers' own attention, written out in torch ops
        model.set_attn_implementation(args.attention)
    named = {"default": True, "none": False, "coordinate-descent": dict(COORDINATE_DESCENT)}
    compile_mode: bool | str | dict[str, Any] = named.get(args.compile, args.compile)
    if args.option:  # Inductor options on top of the default mode (or coordinate descent)
        base = compile_mode if isinstance(compile_mode, dict) else {}
        if not isinstance(compile_mode, dict) and compile_mode is not True:
            raise SystemExit("--option goes with --compile default or coordinate-descent")
        compile_mode = {**base, **dict(_option(o) for o in args.option)}
    if args.products == "cublas" and fuse:  # the Decoder keeps an earlier fusion's products
        from cudagraphs.decoding.fused_projections import fuse_projections

        fuse_projections(model)
    start = time.perf_counter()
    decoder = Decoder(
        model, max_batch=1, max_length=args.max_length, batch_sizes=[1], compile=compile_mode,
        fuse=fuse, grouped_attention=grouped, attention_kernel=kernel,
    )  # fmt: skip
    setup_s = time.perf_counter() - start
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), device=device)

    def request(new: int = args.new) -> None:
        decoder.generate(prompt, max_new_tokens=new, eos_token_id=None)
        if cuda:
            torch.cuda.synchronize()

    request()  # warm
    start = time.perf_counter()
    request()
    wall = time.perf_counter() - start
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        request()
    per_kernel = _per_kernel(prof, cuda)
    # A request of one new token: the prompt's prefill and what a request does once, which
    # the difference leaves out of the kernels per decode step.
    with torch_profile(activities=activities) as once:
        request(1)
    request_kernels = sum(count for count, _ in _per_kernel(once, cuda).values())
    tokens = args.new
    kernels = sum(count for count, _ in per_kernel.values())
    busy_us = sum(us for _, us in per_kernel.values())
    weights, bandwidth = weight_bytes(model), memory_bandwidth()
    ranked = sorted(per_kernel.items(), key=lambda item: -item[1][1])  # the costliest first
    costliest = ranked[:10]
    classes: dict[str, list[float]] = {}
    for name, (count, us) in per_kernel.items():
        totals = classes.setdefault(kernel_class(name), [0.0, 0.0])
        totals[0] += count / tokens
        totals[1] += us / tokens
    return {
        "fuse": fuse,
        "grouped_attention": decoder.stats.attention,
        "fused_groups": decoder.stats.fused_groups,
        "unfused": decoder.stats.unfused,
        "classes": {
            c: {"kernels_per_token": k, "us_per_token": us} for c, (k, us) in classes.items()
        },
        "hardware": torch.cuda.get_device_name() if cuda else "CPU",
        "torch": torch.__version__,
        "model": args.model,
        "dtype": args.dtype,
        "compile": args.compile,
        "compile_argument": repr(compile_mode),
        "sdpa": args.sdpa,
        "attention": args.attention,
        "products": args.products if fuse else "unfused",
        "setup_s": setup_s,
        "cache_length": args.max_length,
        "prompt": args.prompt,
        "new": tokens,
        "tokens_per_s": tokens / wall,
        "wall_us_per_token": 1e6 * wall / tokens,
        "kernels_per_token": kernels / tokens,
        "kernels_per_step": (kernels - request_kernels) / max(1, tokens - 1),
        "gpu_busy_us_per_token": busy_us / tokens,
        "memory_bandwidth": bandwidth,
        "roofline_share": (tokens / wall) * weights / bandwidth,
        "costliest": [
            {
                "kernel": name,
                "calls_per_token": count / tokens,
                "us_per_token": us / tokens,
                "share_of_busy": us / busy_us if busy_us else 0.0,
            }
            for name, (count, us) in costliest
        ],
        # Every kernel with its class, the costliest first: where a class's time goes (which
        # copies a variant adds, say), beyond the ten above.
        "kernels": [
            {
                "kernel": name,
                "class": kernel_class(name),
                "calls_per_token": count / tokens,
                "us_per_token": us / tokens,
            }
            for name, (count, us) in ranked
        ],
    }


GQA_ATTENTION = "decode_profile_sdpa_gqa"


def gqa_attention(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any
) -> tuple[Any, None]:
    """One token's attention as SDPA's own grouped path (``enable_gqa=True``, the query heads
    as they are, the cache not copied); anything else is transformers' SDPA attention. A
    candidate against the library's grouped attention, whose graph has one more copy per layer
    in the profile: likely the view of its output back to one token per head, which cuDNN's
    output layout (positions before heads) cannot give without one (not confirmed)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1 or key.shape[1] == query.shape[1] or kwargs.get("dropout", 0.0):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"),
        enable_gqa=True,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def use_gqa_attention(model: Any) -> None:
    """The model's attention becomes :func:`gqa_attention` (with SDPA's mask function), as
    ``decoding/grouped_attention.py`` does for its own; the Decoder then keeps it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_ATTENTION, gqa_attention)
    AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)
    model.set_attn_implementation(GQA_ATTENTION)


def _option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--option``: the value as Python reads it (``1``, ``True``), else the
    string."""
    import ast

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--option {text!r}: expected KEY=VALUE, e.g. triton.enable_pdl=True")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def attention_kernel(name: str) -> Any:
    """``sdpa_kernel`` for one backend, or a context that changes nothing for ``default``."""
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip
    return sdpa_kernel(backends[name])


def _per_kernel(prof: Any, cuda: bool) -> dict[str, tuple[int, float]]:
    """Kernels as CUPTI saw them (a graph replay's too): calls and µs per name; on a CPU (a
    smoke run of this script) the operators' own time instead."""
    from torch.autograd import DeviceType

    per_kernel: dict[str, tuple[int, float]] = {}
    for entry in prof.key_averages():
        on_gpu = entry.device_type == DeviceType.CUDA
        if on_gpu or (not cuda and entry.self_cpu_time_total > 0):
            us = entry.self_device_time_total if on_gpu else entry.self_cpu_time_total
            per_kernel[entry.key] = (entry.count, float(us))
    return per_kernel


def markdown(r: dict[str, Any]) -> list[str]:
    fused = f", fuse={r['fuse']}" if "fuse" in r else ""
    if "grouped_attention" in r:
        fused += f", attention: {r['grouped_attention']}"
    lines = [
        f"Hardware: {r['hardware']}, torch {r['torch']}; {r['model']} ({r['dtype']}), batch 1, "
        f"`Decoder(compile={r.get('compile_argument', repr(r['compile']))}{fused})`, "
        f"attention {r.get('attention', 'sdpa')} (kernel {r.get('sdpa', 'default')}), "
        + (f"{PRODUCTS[r['products']]}, " if r.get("products") in PRODUCTS else "")
        + f"cache length {r['cache_length']}, a request of {r['prompt']} + {r['new']} tokens (the "
        "profiled one; the timed one before it unprofiled).",
        "",
        f"- tokens/s {r['tokens_per_s']:.1f}; wall {r['wall_us_per_token']:.1f} µs per token; "
        f"GPU kernel time {r['gpu_busy_us_per_token']:.1f} µs per token; "
        f"{r['kernels_per_token']:.1f} kernels per token; weight-streaming roofline share "
        f"{100 * r['roofline_share']:.1f}%"
        + (f" ({rate.strip()})" if (rate := at_bandwidth(r.get("memory_bandwidth", 0))) else "")
        + (f"; construction {r['setup_s']:.1f} s" if "setup_s" in r else ""),
        "",
        f"batch 1, {'fused' if r.get('fuse') else 'unfused'} projections"
        + (
            f", {r['attention']} attention"
            if r.get("attention", "sdpa") != "sdpa"
            else ", expanded attention"
            if not r.get("grouped_attention", "grouped").startswith("grouped")
            else ", grouped attention through SDPA"
            if r.get("grouped_attention") == "grouped"
            else ""
        )
        + ": roofline share "
        f"{100 * r['roofline_share']:.0f} %",
        "",
        f"kernels per token {r['kernels_per_token']:.0f}"
        + (
            f" ({r['kernels_per_step']:.0f} per decode step, without the prefill and what a "
            "request does once)"
            if "kernels_per_step" in r
            else ""
        ),
        "",
    ]
    if r.get("fuse"):
        lines += [f"{r['fused_groups']} projection groups fused"
                  + "".join(f"; unfused: {why}" for why in r["unfused"]), ""]  # fmt: skip
    if "classes" in r:
        lines += ["| kernel class | kernels per token | µs per token |", "|---|---|---|"]
        for name, c in sorted(r["classes"].items(), key=lambda item: -item[1]["us_per_token"]):
            lines.append(f"| {name} | {c['kernels_per_token']:.1f} | {c['us_per_token']:.1f} |")
        lines.append("")
    lines += [
        "| kernel | calls per token | µs per token | share of kernel time |",
        "|---|---|---|---|",
    ]
    for k in r["costliest"]:
        name = k["kernel"].replace("|", "/")
        name = name if len(name) <= 90 else name[:87] + "..."
        lines.append(
            f"| `{name}` | {k['calls_per_token']:.1f} | {k['us_per_token']:.1f} | "
            f"{100 * k['share_of_busy']:.1f}% |"
        )
    return [*lines, ""]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama-2048")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-length", type=int, default=168)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument(
        "--compile",
        default="default",
        help="'default' (compile=True), a torch.compile mode, 'coordinate-descent' "
        "(compile={'coordinate_descent_tuning': True}), or 'none' (eager kernels)",
    )
    p.add_argument(
        "--sdpa",
        default="default",
        choices=["default", "flash", "efficient", "cudnn", "math"],
        help="scaled-dot-product attention's kernel (default: PyTorch's choice)",
    )
    p.add_argument(
        "--products",
        default="default",
        choices=sorted(PRODUCTS),
        help="'default': the Decoder's own fusion, every one-row product on the Triton kernel "
        "of decoding/matvec.py (the down product with SiLU(gate) * up inside); 'cublas': "
        "fuse_projections(model) before the Decoder, which keeps cuBLAS's products",
    )
    p.add_argument(
        "--attention",
        default="sdpa",
        choices=["sdpa", "eager", "gqa"],
        help="transformers' attention implementation: 'eager' writes it out in torch ops (two "
        "products and a softmax), which Inductor may fuse with its neighbours; 'gqa': one "
        "token's attention through SDPA's enable_gqa (the Decoder keeps it, instead of its "
        "grouped attention)",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an Inductor option for the compile (repeatable), e.g. triton.enable_pdl=True or "
        "max_autotune_gemm=True",
    )
    p.add_argument(
        "--variants",
        default="fused",
        help="comma-separated: 'unfused' (Decoder(fuse=False)), 'expanded' (fused, "
        "grouped_attention=False: the model's own SDPA attention), 'grouped-sdpa' (fused, "
        "attention_kernel=False: the grouped attention through SDPA) and/or 'fused' (the "
        "default), profiled in this order in one run",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args()
    variants = args.variants.split(",")
    known = ("unfused", "expanded", "grouped-sdpa", "fused")
    if not variants or any(v not in known for v in variants):
        p.error(f"--variants {args.variants}: expected some of {', '.join(known)}, comma-separated")
    warnings.filterwarnings("ignore")
    runs = []
    for variant in variants:
        with torch.no_grad(), attention_kernel(args.sdpa):
            runs.append(
                profile(
                    args, fuse=variant != "unfused", grouped=variant != "expanded",
                    kernel=variant != "grouped-sdpa",
                )
            )  # fmt: skip
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    results: Any = runs[0] if len(runs) == 1 else runs
    text = "\n".join(line for r in runs for line in markdown(r))
    print(text, flush=True)
    args.json = args.json or RESULTS / f"decode-profile-{args.model}.json"
    write(results, text + "\n", args, Console())


if __name__ == "__main__":
    main()
