"""RL algorithms: config dataclasses and the pure loss/advantage functions."""

from rollart_nb.algo.grpo import GRPO, group_advantages, grpo_loss, loss_weights

__all__ = ["GRPO", "group_advantages", "grpo_loss", "loss_weights"]
