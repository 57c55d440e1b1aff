"""The wavefunction: a seqlab Decoder over pair tokens (amplitudes) plus a small MLP (phase).

    psi(x) = sqrt(P(x)) * exp(i phi(x)),   P(x) = prod_i P(t_i | t_<i)

The decoder is the same ``seqlab.model.Decoder`` the language models use, with a 5-token vocabulary: the four pair
tokens of ``space.py`` and BOS, which starts every sequence (the first orbital is conditioned on nothing but BOS).
Before each softmax the tokens that would break N_alpha / N_beta conservation are masked to -inf, so P is normalised
over valid configurations only and every sample is physical. The phase is an MLP over the one-hot configuration
(as in NAQS and QiankunNet): it must see the *whole* configuration, which the autoregressive conditionals do not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqlab.config import ModelConfig
from seqlab.model import build_model
from seqlab.nnqs.space import N_PAIR_TOKENS, valid_token_mask

BOS = N_PAIR_TOKENS  # token id 4


@dataclass
class AnsatzConfig:
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None
    pos: str = "learned"  # each position is a specific orbital; a learned table says which
    phase_hidden: int = 128
    phase_layers: int = 2

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "phase_hidden", "phase_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"AnsatzConfig.{name}: must be a positive integer, got {v!r}")


class Wavefunction(nn.Module):
    def __init__(self, n_orb: int, n_alpha: int, n_beta: int, cfg: AnsatzConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or AnsatzConfig()
        self.n_orb, self.n_alpha, self.n_beta = n_orb, n_alpha, n_beta
        self.model_config = ModelConfig(
            arch="decoder", vocab_size=N_PAIR_TOKENS + 1, d_model=cfg.d_model, n_layers=cfg.n_layers,
            n_heads=cfg.n_heads, d_ff=cfg.d_ff, max_seq_len=n_orb, pos=cfg.pos, tie_embeddings=False,
            bos_token_id=BOS,
        )
        self.decoder = build_model(self.model_config)
        layers: list[nn.Module] = []
        d_in = n_orb * N_PAIR_TOKENS
        for _ in range(cfg.phase_layers):
            layers += [nn.Linear(d_in, cfg.phase_hidden), nn.GELU()]
            d_in = cfg.phase_hidden
        layers.append(nn.Linear(d_in, 1))
        self.phase_net = nn.Sequential(*layers)

    def config_dict(self) -> dict:
        return {"n_orb": self.n_orb, "n_alpha": self.n_alpha, "n_beta": self.n_beta, "ansatz": asdict(self.cfg)}

    # --- conditionals ---------------------------------------------------------------------------------------
    def masked_log_probs(self, logits: Tensor, alpha_left: Tensor, beta_left: Tensor, orbitals_left) -> Tensor:
        """Decoder logits [..., V] -> log P(t | prefix) over the 4 pair tokens, invalid tokens at -inf."""
        valid = valid_token_mask(alpha_left, beta_left, orbitals_left)
        logits = logits[..., :N_PAIR_TOKENS].float().masked_fill(~valid, float("-inf"))
        lp = F.log_softmax(logits, dim=-1)
        # a prefix that already broke conservation has no valid token: every continuation gets -inf, not NaN
        return torch.where(valid.any(-1, keepdim=True), lp, torch.full_like(lp, float("-inf")))

    def conditional_log_probs(self, tokens: Tensor) -> Tensor:
        """[B, n_orb] configurations -> [B, n_orb, 4] log P(t_i = . | t_<i), all positions in one parallel pass."""
        B, n = tokens.shape
        bos = torch.full((B, 1), BOS, dtype=torch.long, device=tokens.device)
        logits = self.decoder(torch.cat((bos, tokens[:, :-1].long()), 1))
        n_a = torch.cumsum(tokens & 1, 1) - (tokens & 1)  # electrons placed before orbital i
        n_b = torch.cumsum(tokens >> 1, 1) - (tokens >> 1)
        left = torch.arange(n, 0, -1, device=tokens.device)  # orbitals i..n-1 still to fill
        return self.masked_log_probs(logits, self.n_alpha - n_a, self.n_beta - n_b, left)

    def log_prob(self, tokens: Tensor) -> Tensor:
        """log P(x) [B] (float32; -inf for configurations with the wrong electron counts)."""
        lp = self.conditional_log_probs(tokens)
        return lp.gather(-1, tokens.long()[..., None]).squeeze(-1).sum(-1)

    def phase(self, tokens: Tensor) -> Tensor:
        # one-hot by comparison, not F.one_hot: the same numbers, and it vectorises under torch.func.vmap (sr.py)
        classes = torch.arange(N_PAIR_TOKENS, device=tokens.device)
        x = (tokens.long()[..., None] == classes).flatten(-2).to(self.phase_net[0].weight.dtype)
        return self.phase_net(x).squeeze(-1)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(log P(x), phi(x)) for [B, n_orb] configurations; differentiable."""
        return self.log_prob(tokens), self.phase(tokens)

    @torch.no_grad()
    def log_psi(self, tokens: Tensor, batch_size: int = 16384) -> Tensor:
        """log psi = 1/2 log P + i phi as complex128, evaluated in batches without gradients."""
        out = []
        for start in range(0, len(tokens), batch_size):
            lp, ph = self(tokens[start : start + batch_size])
            out.append(torch.complex(0.5 * lp.double(), ph.double()))
        return torch.cat(out) if out else torch.empty(0, dtype=torch.complex128)
