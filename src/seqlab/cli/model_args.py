"""The model flags ``seqlab generate``, ``chat``, ``perplexity`` and ``serve`` share (``info`` the quantisation
ones), spelled and loaded once.

    --checkpoint DIR   a seqlab model folder, a training checkpoint, or a run directory (its latest checkpoint)
    --gguf PATH        a llama.cpp GGUF file (weights, tokenizer and chat template inside)
    --model HFDIR      a Hugging Face folder (config.json + model.safetensors + tokenizer.json)
    --dtype auto|fp32|bf16  (float32 / bfloat16 accepted too)     --device cpu|cuda[:N]

Whatever the source, the result is ``(model, tokenizer, source)`` with the one seqlab Tokenizer, so the
commands differ only in what they do with the model.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from seqlab.data import Tokenizer, load_tokenizer
from seqlab.io import load_gguf, load_hf, load_pretrained, resolve_checkpoint
from seqlab.io.gguf_file import refuse_gguf_file
from seqlab.quant.convert import cast_unquantised, quantize
from seqlab.runtime.dist import resolve_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
QUANT_CHOICES = ("int8", "int4", "gguf")
_DTYPE_ALIASES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16"}


def _dtype_name(text: str) -> str:
    return _DTYPE_ALIASES.get(text.lower(), text)


AUTO_DTYPE = ("fp32 weights; bf16 products for long prompts and batched decoding only where this CPU has native "
              "bf16 and they measure faster, see docs/acceleration.md")


def add_model_source(p: argparse.ArgumentParser, required: bool = True, auto_dtype: str = AUTO_DTYPE) -> None:
    """``--checkpoint | --gguf | --model`` (exactly one), ``--dtype`` and ``--device``. ``auto_dtype``: what
    ``--dtype auto`` means for this command (``serve`` and ``perplexity`` run in the loaded dtype)."""
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--checkpoint", metavar="DIR",
                     help="seqlab model folder, training checkpoint, or run directory (uses its latest checkpoint)")
    src.add_argument("--gguf", metavar="PATH", help="GGUF file (llama/qwen2/qwen3, byte-level BPE vocabulary)")
    src.add_argument("--model", metavar="HFDIR", help="Hugging Face folder (config.json, model.safetensors, "
                                                      "tokenizer.json)")
    p.add_argument("--dtype", type=_dtype_name, choices=(*DTYPES, "auto"), default="auto",
                   help=f"compute dtype: auto (default: {auto_dtype}), fp32 (exactly fp32 everywhere), or bf16 "
                        "(float32/bfloat16 are accepted too)")
    p.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda[:N], or auto (a GPU if any)")
    add_quant_flags(p)


def add_quant_flags(p: argparse.ArgumentParser) -> None:
    """``--quant`` and ``--group-size``: a dense model quantised as it loads."""
    p.add_argument("--quant", choices=QUANT_CHOICES, default=None,
                   help="weight-only quantised inference: int8 (groups of 32; one scale per output channel for a "
                        "layer 32 does not divide), int4 (groups of 64; 32 for a GGUF file), or gguf (a GGUF file's "
                        "Q4/Q8 blocks kept as they are; see docs/quantization.md)")
    p.add_argument("--group-size", type=int, default=None, choices=(0, 32, 64, 128), metavar="N",
                   help="with --quant int8/int4: weights per scale (32, 64 or 128; int8 also 0 = one per output "
                        "channel), as `seqlab quantize --group-size`")


def check_quant_flags(quant: str | None, group_size: int | None, may_be_quantised: bool) -> None:
    """Refuse a ``--group-size`` the flags alone rule out, before the (slow) load. ``may_be_quantised``: the source
    is a folder, which may hold a model `seqlab quantize` wrote (``apply_quant`` then decides, after the load)."""
    if group_size is None:
        return
    if quant == "gguf":
        raise ValueError(f"--group-size {group_size}: not with --quant gguf, which keeps the file's blocks")
    if quant is None and not may_be_quantised:
        raise ValueError(f"--group-size {group_size}: only with --quant int8 or int4")
    if group_size == 0 and quant == "int4":
        raise ValueError("--group-size 0 (one scale per output channel) is int8's; int4 takes 32, 64 or 128")


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    path: Path


def load_model(args: argparse.Namespace, default_gguf: Path | None = None) -> LoadedModel:
    """The model and tokenizer the flags name (``default_gguf`` when none is given), on ``--device``."""
    device = resolve_device(args.device)
    dtype = DTYPES.get(args.dtype, torch.float32)  # auto: load fp32, the accelerator picks the compute dtype
    group_size = getattr(args, "group_size", None)
    check_quant_flags(args.quant, group_size, may_be_quantised=bool(args.checkpoint))
    # int8/int4 round the fp32 weights; the rest of the model takes --dtype after (quant.convert.cast_unquantised)
    dense = torch.float32 if args.quant in ("int8", "int4") else dtype
    if args.checkpoint:
        refuse_gguf_file(args.checkpoint)
        folder = resolve_checkpoint(args.checkpoint)
        model = apply_quant(load_pretrained(folder, dtype=dense, device=device), args.quant, f"--checkpoint {folder}",
                            group_size, dtype)
        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file():
            raise FileNotFoundError(f"{tok_path}: no tokenizer next to the checkpoint; text prompts need one")
        tokenizer = load_tokenizer(tok_path)
        if source_kind(model) == "seqlab":
            use_trained_special_rule(tokenizer, model.config.arch)
        return LoadedModel(model, tokenizer, folder)
    if args.model:
        folder = Path(args.model)
        model = apply_quant(load_hf(folder, dtype=dense, device=device), args.quant, f"--model {folder}", group_size,
                            dtype)
        return LoadedModel(model, Tokenizer.from_pretrained(folder), folder)
    path = Path(args.gguf) if args.gguf else default_gguf
    if path is None:
        raise ValueError("no model given: pass --checkpoint DIR, --gguf PATH or --model HFDIR")
    if group_size is None:
        model, tokenizer = load_gguf(path, dtype=dtype, device=device, quant=args.quant)
    else:  # the file's weights, dense, re-quantised at the size asked for
        model, tokenizer = load_gguf(path, dtype=dense, device=device)
        model = apply_quant(model, args.quant, f"--gguf {path}", group_size, dtype)
    return LoadedModel(model, tokenizer, path)


def source_kind(model: nn.Module) -> str:
    """Where a seqlab checkpoint's weights came from: ``"hf"`` or ``"gguf"`` (converted or quantised from such a
    file: its tokenizer's own BOS rule holds), else ``"seqlab"`` (trained here, every document began with BOS)."""
    kind = str(model.config.extra.get("source", "")).partition(":")[0]
    return kind if kind in ("hf", "gguf") else "seqlab"


def use_trained_special_rule(tokenizer: Tokenizer, arch: str) -> None:
    """Give the tokenizer of a model trained by seqlab the special tokens its training inputs had, as its
    ``add_special_tokens=True`` rule: a decoder's documents begin with BOS, an encoder's rows are [BOS] ... [EOS]
    (BERT's CLS and SEP), an encoder-decoder's sources end with EOS. Prompts and exports then both follow it."""
    add_bos, add_eos = {"decoder": (True, False), "encoder": (True, True), "encoder_decoder": (False, True)}[arch]
    tokenizer.set_special_rule(add_bos and tokenizer.bos_id is not None, add_eos and tokenizer.eos_id is not None)


def prompt_ids(loaded: LoadedModel, text: str, bos: bool = True) -> list[int]:
    """A plain prompt as ids, by the tokenizer's rule: for a seqlab checkpoint the special tokens its training inputs
    had (``use_trained_special_rule``, set at load: BOS for a decoder); HF and GGUF models follow their own
    ``add_bos_token``. ``bos=False`` adds nothing."""
    return loaded.tokenizer.encode(text, add_special_tokens=bos)


def apply_quant(model: nn.Module, quant: str | None, source: str, group_size: int | None = None,
                dtype: torch.dtype | None = None) -> nn.Module:
    """Quantise a loaded dense (fp32) model for ``--quant`` (``gguf`` keeps a GGUF file's blocks, so it applies at
    load), in groups of ``group_size`` (None: the scheme's default); the layers left dense then take ``dtype``."""
    if quant is None:
        if group_size is not None and model.config.extra.get("quant"):
            raise ValueError(f"--group-size {group_size}: {source} is already quantised (seqlab quantize); drop "
                             f"--group-size")
        check_quant_flags(quant, group_size, may_be_quantised=False)
        return model
    if model.config.extra.get("quant"):
        raise ValueError(f"--quant {quant}: {source} is already quantised (seqlab quantize); drop --quant")
    if quant == "gguf":
        raise ValueError(f"--quant gguf keeps a GGUF file's blocks; {source} is not a GGUF file (use int8 or int4)")
    return cast_unquantised(quantize(model, bits=int(quant[3:]), group_size=group_size), dtype)
