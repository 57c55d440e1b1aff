"""Shared by the accelerator tests: a tiny model, a deliberately slow route, and greedy-token equality that rests
on a margin."""
import time

import torch

from seqlab.config import ModelConfig
from seqlab.generate.engine import decode_step
from seqlab.accel.routes import PackedRoute
from seqlab.model import build_model


def tiny_model(tie: bool = True, bias: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64,
                      tie_embeddings=tie, bias=bias)
    return build_model(cfg).eval()


class SleepyPacked(PackedRoute):
    """The packed route with a sleep in every product of the layers it converts; ``converted`` counts them."""

    name = "sleepy-packed"
    sleep_s = 0.05
    converted = 0

    def convert(self, layer, use):
        type(self).converted += 1
        packed = super().convert(layer, use)
        inner = packed.forward

        def slow(x):
            time.sleep(self.sleep_s)
            return inner(x)

        packed.forward = slow
        return packed


def assert_same_greedy_tokens(reference_model, prompt_len: int, expected: torch.Tensor, got: torch.Tensor,
                              margin: float) -> None:
    """``got`` equals ``expected`` up to each row's first step whose top-2 logit gap is below ``margin``.

    Why a margin: two numerics paths (packed vs dense kernels, compiled vs eager, another ISA's vector width) agree
    on logits only to rounding. Where the two best logits are closer than that, either token is a correct greedy
    choice and the rows may legitimately diverge from there on; everywhere before, they must be identical. The gaps
    come from a plain full forward pass of ``reference_model`` over ``expected`` (rows without padding).
    """
    assert expected.shape == got.shape
    with torch.no_grad():
        logits = reference_model(expected).float()
    top2 = logits[:, prompt_len - 1:-1].topk(2, dim=-1).values
    gaps = top2[..., 0] - top2[..., 1]  # [batch, new tokens]: how decided each greedy step was
    for row in range(expected.shape[0]):
        close = (gaps[row] < margin).nonzero()
        stop = prompt_len + (int(close[0]) if len(close) else gaps.shape[1])
        assert torch.equal(got[row, :stop], expected[row, :stop]), (row, stop, got[row], expected[row])


def assert_same_prefill_and_next_step(model, plain, got, want, cache, plain_cache, atol: float = 1e-5) -> None:
    """An accelerated prefill (``got``, ``cache``) against the plain model's: the logits, every layer's keys and
    values, and the greedy decode step after it agree to ``atol`` (fp32: only the summation order differs)."""
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    n = plain_cache.pos
    assert cache.pos == n
    for layer in range(len(cache.k)):  # the slots written (the rest is unfilled memory)
        torch.testing.assert_close(cache.k[layer][:, :, :n], plain_cache.k[layer][:, :, :n], atol=atol, rtol=atol)
        torch.testing.assert_close(cache.v[layer][:, :, :n], plain_cache.v[layer][:, :, :n], atol=atol, rtol=atol)
    tok = got.argmax(-1)
    torch.testing.assert_close(decode_step(model, tok, cache), decode_step(plain, tok, plain_cache), atol=atol,
                               rtol=atol)
