"""Pure tensor math of RL post-training: advantages, policy losses, KL, aggregation, DPO.

Tensors in, tensors out: no model, no config object, no I/O. Each swappable
piece is registered by the name a recipe uses; look it up through the
``get_*`` functions, which name the valid choices on a typo.
"""

from rlpost.algos import advantages_extra as _advantages_extra  # noqa: F401  (registers)
from rlpost.algos import distill as _distill  # noqa: F401  (registers)
from rlpost.algos import policy_losses_extra as _policy_losses_extra  # noqa: F401  (registers)
from rlpost.algos.advantages import ADVANTAGES, get_advantage_estimator, scores_to_token_rewards
from rlpost.algos.aggregate import (
    AGGREGATIONS,
    Aggregation,
    get_aggregation,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from rlpost.algos.dpo import dpo_loss
from rlpost.algos.entropy import entropy_from_logits
from rlpost.algos.kl import KL_ESTIMATORS, KLCoefficient, get_kl_estimator, kl_penalized_rewards
from rlpost.algos.policy_losses import POLICY_LOSSES, PolicyLossOutput, get_policy_loss
from rlpost.algos.sampling import (
    group_has_spread,
    group_zero_spread_fraction,
    groups_with_spread,
    overlong_penalty,
)
from rlpost.algos.value import value_loss

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "Aggregation",
    "KLCoefficient",
    "PolicyLossOutput",
    "dpo_loss",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_aggregation",
    "get_kl_estimator",
    "get_policy_loss",
    "group_has_spread",
    "group_zero_spread_fraction",
    "groups_with_spread",
    "kl_penalized_rewards",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "scores_to_token_rewards",
    "value_loss",
]
