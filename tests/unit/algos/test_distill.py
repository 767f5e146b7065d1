"""On-policy distillation math (rlpost/algos/distill.py) against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos import ADVANTAGES, POLICY_LOSSES
from rlpost.algos.aggregate import Aggregation
from rlpost.algos.distill import (
    distill_kl,
    divergence_tokens,
    on_policy_distill_advantages,
    reverse_kl_tokens,
)
from tests.unit.algos.losscall import policy_loss

STUDENT = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0], [-3.0, -3.0, -3.0]])
TEACHER = torch.tensor([[-1.5, -1.0, -3.0], [-2.0, -9.0, 0.0], [-1.0, -1.0, -1.0]])
# row 2 is fully masked (a dropped sample): it must contribute nothing, not NaN
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_reverse_kl_tokens_by_hand():
    kl = reverse_kl_tokens(STUDENT, TEACHER, MASK)
    assert torch.equal(kl, torch.tensor([[0.5, -1.0, 0.0], [1.5, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    # (0.5 - 1.0 + 1.5) / 3 valid tokens
    assert distill_kl(STUDENT, TEACHER, MASK) == pytest.approx(1.0 / 3.0)


def test_fully_masked_batch_gives_zero_kl_and_advantage():
    zero = torch.zeros_like(MASK)
    assert distill_kl(STUDENT, TEACHER, zero) == 0.0
    adv, ret = on_policy_distill_advantages(
        torch.zeros(3, 3), zero, torch.tensor([0, 0, 1]), old_logprobs=STUDENT,
        teacher_logprobs=TEACHER,
    )  # fmt: skip
    assert torch.equal(adv, torch.zeros(3, 3)) and torch.equal(ret, adv)


def test_distill_advantage_is_negative_reverse_kl_times_weight():
    adv, _ = on_policy_distill_advantages(
        torch.zeros(3, 3), MASK, torch.tensor([0, 1, 2]), old_logprobs=STUDENT,
        teacher_logprobs=TEACHER, distill_weight=2.0,
    )  # fmt: skip
    assert torch.equal(adv, torch.tensor([[-1.0, 2.0, 0.0], [-3.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_center_subtracts_the_mean_kl_over_valid_tokens():
    adv, _ = on_policy_distill_advantages(
        torch.zeros(3, 3), MASK, torch.tensor([0, 1, 2]), old_logprobs=STUDENT,
        teacher_logprobs=TEACHER, center=True,
    )  # fmt: skip
    # k = [0.5, -1, 1.5] on the valid tokens, mean 1/3; padding stays 0
    want = torch.tensor([[-0.5 + 1 / 3, 1.0 + 1 / 3, 0.0], [-1.5 + 1 / 3, 0.0, 0.0], [0.0] * 3])
    assert torch.allclose(adv, want, atol=1e-6)


def test_task_weight_adds_grpo_advantage():
    # rows 0 and 1 share a prompt with scores 1 and 0 (on each row's last valid token):
    # GRPO gives +-0.5 / (std 0.7071 + 1e-6); row 2 is alone and masked.
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    adv, _ = on_policy_distill_advantages(
        rewards, MASK, torch.tensor([0, 0, 1]), old_logprobs=STUDENT, teacher_logprobs=TEACHER,
        distill_weight=1.0, task_weight=0.5,
    )  # fmt: skip
    g = 0.5 / (math.sqrt(0.5) + 1e-6)
    want = torch.tensor(
        [[-0.5 + 0.5 * g, 1.0 + 0.5 * g, 0.0], [-1.5 - 0.5 * g, 0.0, 0.0], [0.0] * 3]
    )
    assert torch.allclose(adv, want, atol=1e-6)


def test_registered_with_the_traits_the_plan_reads():
    assert ADVANTAGES.trait("on_policy_distill", "needs_teacher")
    assert POLICY_LOSSES.trait("gkd", "needs_teacher_logits")
    assert not ADVANTAGES.trait("on_policy_distill", "group_relative")  # n=1 is fine


# Two-token vocabulary: teacher p_t = [.5, .5], student p_s = [.75, .25].
T_LOGITS = torch.tensor([[[0.0, 0.0]]])
S_LOGITS = torch.tensor([[[math.log(3.0), 0.0]]])


@pytest.mark.parametrize(
    ("divergence", "want"),
    [
        # .5 ln(.5/.75) + .5 ln(.5/.25)
        ("forward_kl", 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(2.0)),
        # .75 ln(.75/.5) + .25 ln(.25/.5)
        ("reverse_kl", 0.75 * math.log(1.5) + 0.25 * math.log(0.5)),
        # m = [.625, .375]: .5 KL(t||m) + .5 KL(s||m)
        (
            "jsd",
            0.5 * (0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375))
            + 0.5 * (0.75 * math.log(0.75 / 0.625) + 0.25 * math.log(0.25 / 0.375)),
        ),
    ],
)
def test_divergences_by_hand(divergence, want):
    got = divergence_tokens(S_LOGITS, T_LOGITS, divergence, beta=0.5)
    assert got.shape == (1, 1)
    assert float(got) == pytest.approx(want, rel=1e-5)


def test_jsd_weights_the_mixture_by_beta():
    # beta = 0.25: m = .25 p_t + .75 p_s = [.6875, .3125]
    m = [0.25 * 0.5 + 0.75 * 0.75, 0.25 * 0.5 + 0.75 * 0.25]
    kl_t = 0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1])
    kl_s = 0.75 * math.log(0.75 / m[0]) + 0.25 * math.log(0.25 / m[1])
    got = float(divergence_tokens(S_LOGITS, T_LOGITS, "jsd", beta=0.25))
    assert got == pytest.approx(0.25 * kl_t + 0.75 * kl_s, rel=1e-5)


def test_divergence_is_zero_for_equal_distributions_and_refuses_bad_input():
    logits = torch.randn(2, 3, 5)
    for d in ("forward_kl", "reverse_kl", "jsd"):
        assert torch.allclose(
            divergence_tokens(logits, logits.clone(), d), torch.zeros(2, 3), atol=1e-6
        )
    with pytest.raises(ValueError, match="divergence must be one of"):
        divergence_tokens(logits, logits, "tv")
    with pytest.raises(ValueError, match="teacher logits"):
        divergence_tokens(logits, logits[:, :2])


def _gkd_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 3, 6, generator=g).requires_grad_(True)
    teacher = torch.randn(4, 3, 6, generator=g).requires_grad_(True)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
    lp = torch.log_softmax(logits, -1)[..., 0]
    return logits, teacher, mask, lp


def test_gkd_loss_is_the_masked_mean_divergence_with_gradient_to_the_student_only():
    logits, teacher, mask, lp = _gkd_inputs()
    out = policy_loss("gkd")(
        lp, lp.detach(), torch.zeros_like(mask), mask, agg=Aggregation("token-mean"),
        logits=logits, teacher_logits=teacher, divergence="forward_kl",
    )  # fmt: skip
    div = divergence_tokens(logits, teacher, "forward_kl")
    want = float((div.detach() * mask).sum() / mask.sum())
    assert out.loss.detach().item() == pytest.approx(want, rel=1e-6)
    assert float(out.stats["distill_div"]) == pytest.approx(want, rel=1e-6)
    out.loss.backward()
    assert teacher.grad is None
    assert torch.equal(logits.grad[3], torch.zeros(3, 6))  # the fully masked row
    assert logits.grad[0].abs().sum() > 0


def test_gkd_loss_is_micro_batch_invariant():
    logits, teacher, mask, lp = _gkd_inputs(1)
    agg = Aggregation.for_minibatch(mask, "token-mean")

    def loss(rows):
        return policy_loss("gkd")(
            lp[rows], lp[rows].detach(), torch.zeros_like(mask[rows]), mask[rows], agg=agg,
            logits=logits[rows], teacher_logits=teacher[rows],
        ).loss  # fmt: skip

    whole = loss(torch.arange(4))
    split = loss(torch.tensor([0, 2])) + loss(torch.tensor([1, 3]))
    assert split.detach().item() == pytest.approx(whole.detach().item(), rel=1e-6)


def test_gkd_task_weight_adds_the_ppo_term():
    logits, teacher, mask, lp = _gkd_inputs(2)
    adv = torch.ones_like(mask)
    kw = {"agg": Aggregation("token-mean"), "logits": logits, "teacher_logits": teacher}
    alone = policy_loss("gkd")(lp, lp.detach(), adv, mask, **kw).loss
    both = policy_loss("gkd")(lp, lp.detach(), adv, mask, task_weight=0.5, **kw).loss
    # ratio 1 on every token: the PPO term is -mean(A) = -1
    assert (both - alone).detach().item() == pytest.approx(-0.5, rel=1e-6)


def test_gkd_without_teacher_logits_names_the_problem():
    _, _, mask, lp = _gkd_inputs()
    with pytest.raises(ValueError, match="full logits"):
        policy_loss("gkd")(lp, lp, mask, mask, agg=Aggregation("token-mean"))
