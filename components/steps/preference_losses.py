"""The losses of preference tuning (kind ``preference_loss``), each chosen with one TOML line.

Each loss maps a batch's sequence log-probabilities (``PairLogps``) to one loss per pair and the
implicit rewards TRL logs. With a reference (DPO, IPO, hinge) the reward of a completion is
``beta * (log pi(y|x) - log pi_ref(y|x))``; the reference-free ones (SimPO, ORPO) use the
policy's mean token log-probability. Definitions follow the papers and TRL 1.16
(``DPOTrainer``; ``CPOTrainer`` for SimPO; ``ORPOTrainer``), which the tests compare against;
where kiln differs, the class says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from pydantic import Field

from kiln.components.base import ComponentConfig
from kiln.components.registry import register


@dataclass
class PairLogps:
    """One micro-batch of pairs, (B,) each: the completions' summed token log-probabilities
    under the policy and the reference (None without one), and their token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None
    # Unpaired examples (KTO): "chosen" holds each example, "rejected" its mismatched row
    # (its prompt with another example's completion), ``desirable`` each example's label.
    desirable: torch.Tensor | None = None

    def mean_chosen(self) -> torch.Tensor:
        return self.chosen / self.chosen_tokens.clamp(min=1)

    def mean_rejected(self) -> torch.Tensor:
        return self.rejected / self.rejected_tokens.clamp(min=1)

    def nll(self) -> torch.Tensor:
        """The chosen completions' mean token negative log-likelihood (the SFT term)."""
        return -self.chosen.sum() / self.chosen_tokens.sum().clamp(min=1)


@dataclass
class PairLoss:
    """Per pair: the loss and the rewards of each side (detached); scalars to log."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


class BetaConfig(ComponentConfig):
    beta: float = Field(0.1, gt=0, description="inverse temperature: how far the policy may "
                        "move from the reference (larger = closer)")


class Smoothing(ComponentConfig):
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="assumed share of flipped "
                                   "labels (conservative DPO); 0 = none")


class SmoothedConfig(BetaConfig, Smoothing):
    pass


class DPOConfig(SmoothedConfig):
    sft_weight: float = Field(0.0, ge=0, description="weight of the chosen completions' mean "
                              "token NLL added to the loss (RPO, Pang et al. 2024; TRL's loss "
                              'types ["sigmoid", "sft"] with these loss_weights); 0 = plain DPO')


def _smoothed(z: torch.Tensor, eps: float) -> torch.Tensor:
    """-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)."""
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def _with_sft(losses: torch.Tensor, p: PairLogps, weight: float
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``losses`` plus ``weight`` times the chosen completions' NLL (logged as ``nll_loss``)."""
    if not weight:
        return losses, {}
    nll = p.nll()
    return losses + weight * nll, {"nll_loss": nll.detach()}


class _WithReference:
    needs_reference = True
    unpaired = False  # trains on chosen / rejected pairs

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def log_ratios(self, p: PairLogps) -> tuple[torch.Tensor, torch.Tensor]:
        return p.chosen - p.ref_chosen, p.rejected - p.ref_rejected

    def rewards(self, chosen: torch.Tensor, rejected: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cfg.beta * chosen.detach(), self.cfg.beta * rejected.detach()


@register("preference_loss", "dpo")
class DPO(_WithReference):
    """DPO (Rafailov et al. 2023); with label_smoothing, conservative DPO (Mitchell 2023).

    -log sigmoid(beta * h), h the chosen minus the rejected log-ratio to the reference; with
    ``label_smoothing`` eps: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h). TRL
    1.16's ``sigmoid`` at eps = 0 (its sigmoid has no smoothing)."""

    Config = DPOConfig

    def __call__(self, p: PairLogps) -> PairLoss:
        c, r = self.log_ratios(p)
        losses = _smoothed(self.cfg.beta * (c - r), self.cfg.label_smoothing)
        losses, extra = _with_sft(losses, p, self.cfg.sft_weight)
        return PairLoss(losses, *self.rewards(c, r), extra=extra)


@register("preference_loss", "ipo")
class IPO(_WithReference):
    """IPO (Azar et al. 2023): a squared loss towards a margin of 1 / (2 beta).

    (h - 1 / (2 beta))^2 with h the difference of the sides' log-ratios per completion token
    (TRL's normalisation, confirmed by TRL with the authors)."""

    Config = BetaConfig

    def __call__(self, p: PairLogps) -> PairLoss:
        c, r = self.log_ratios(p)
        h = c / p.chosen_tokens.clamp(min=1) - r / p.rejected_tokens.clamp(min=1)
        return PairLoss((h - 1 / (2 * self.cfg.beta)) ** 2, *self.rewards(c, r))


@register("preference_loss", "hinge")
class Hinge(_WithReference):
    """Hinge loss on the log-ratios (SLiC, Zhao et al. 2023): relu(1 - beta * h)."""

    Config = BetaConfig

    def __call__(self, p: PairLogps) -> PairLoss:
        c, r = self.log_ratios(p)
        return PairLoss(torch.relu(1 - self.cfg.beta * (c - r)), *self.rewards(c, r))


class ReferenceFreeConfig(ComponentConfig):
    beta: float = Field(0.1, gt=0, description="scale of the length-normalised log-probability "
                        "difference (ORPO: the weight of the odds-ratio term, its lambda)")


class SimPOConfig(ReferenceFreeConfig, Smoothing):
    gamma: float = Field(0.5, ge=0, description="target reward margin (TRL's simpo_gamma)")
    sft_weight: float = Field(0.0, ge=0, description="weight of the chosen completions' NLL "
                              "added to the loss (TRL's cpo_alpha; SimPO itself: 0)")


class _ReferenceFree:
    needs_reference = False
    unpaired = False

    def __init__(self, cfg) -> None:
        self.cfg = cfg


@register("preference_loss", "simpo")
class SimPO(_ReferenceFree):
    """SimPO (Meng et al. 2024): reference-free, length-normalised, with a target margin.

    -log sigmoid(beta * (mean log p(chosen) - mean log p(rejected)) - gamma), the means over
    completion tokens; rewards beta times the means. TRL's ``CPOTrainer`` with ``loss_type =
    "simpo"`` (its ``simpo_gamma`` is ``gamma``)."""

    Config = SimPOConfig

    def __call__(self, p: PairLogps) -> PairLoss:
        c, r = p.mean_chosen(), p.mean_rejected()
        losses = _smoothed(self.cfg.beta * (c - r) - self.cfg.gamma, self.cfg.label_smoothing)
        losses, extra = _with_sft(losses, p, self.cfg.sft_weight)
        return PairLoss(losses, self.cfg.beta * c.detach(), self.cfg.beta * r.detach(),
                        extra=extra)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (Maechler 2012, "Accurately
    computing log(1 - exp(-|a|))"): no library function computes it."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@register("preference_loss", "orpo")
class ORPO(_ReferenceFree):
    """ORPO (Hong et al. 2024): reference-free, the SFT loss plus an odds-ratio term.

    The chosen completions' NLL minus beta times log sigmoid of the log odds ratio of the
    sides' mean token probabilities. The NLL covers the chosen completion's tokens (the
    paper's L_SFT); TRL's ``ORPOTrainer`` also counts the prompt's."""

    Config = ReferenceFreeConfig

    def __call__(self, p: PairLogps) -> PairLoss:
        c, r = p.mean_chosen(), p.mean_rejected()
        log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
        ratio = F.logsigmoid(log_odds)
        nll = p.nll()
        return PairLoss(nll - self.cfg.beta * ratio, self.cfg.beta * c.detach(),
                        self.cfg.beta * r.detach(),
                        {"nll_loss": nll.detach(), "log_odds_ratio": ratio.detach().mean(),
                         "log_odds_chosen": log_odds.detach().mean()})  # TRL's names


class KTOConfig(BetaConfig):
    desirable_weight: float = Field(1.0, gt=0, description="weight of the desirable examples' "
                                    "losses (lambda_D)")
    undesirable_weight: float = Field(1.0, gt=0, description="weight of the undesirable "
                                      "examples' losses (lambda_U)")


@register("preference_loss", "kto")
class KTO(_WithReference):
    """KTO (Ethayarajh et al. 2024): unpaired examples, each desirable or not.

    With z = max(0, mean over the batch's mismatched rows of the policy-to-reference
    log-ratio), all ranks' mean, detached (the KL estimate): a desirable example's loss is
    lambda_D (1 - sigmoid(beta (r - z))), an undesirable one's lambda_U (1 - sigmoid(beta (z -
    r))), r its log-ratio. Needs unpaired data (``completion`` and ``label`` rows). TRL 1.16's
    ``KTOTrainer``."""

    Config = KTOConfig
    unpaired = True

    def __call__(self, p: PairLogps) -> PairLoss:
        from kiln.components import distributed

        ratio = p.chosen - p.ref_chosen
        kl = (p.rejected - p.ref_rejected).mean().detach().reshape(1)
        distributed.all_reduce_(kl)  # (the ranks' mean: each holds as many examples)
        ranks = torch.distributed.get_world_size() if distributed.is_initialized() else 1
        kl = (kl[0] / ranks).clamp(min=0)
        good = p.desirable.to(ratio.device)
        b, c = self.cfg.beta, self.cfg
        losses = torch.where(good, c.desirable_weight * (1 - torch.sigmoid(b * (ratio - kl))),
                             c.undesirable_weight * (1 - torch.sigmoid(b * (kl - ratio))))
        rewards = b * ratio.detach()
        nan = torch.full_like(rewards, float("nan"))
        return PairLoss(losses, torch.where(good, rewards, nan),
                        torch.where(good, nan, rewards), {"kl": kl})
