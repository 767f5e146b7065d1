import copy

import pytest
import torch

from rlpost.algos import (
    get_advantage_estimator,
    get_kl_estimator,
    scores_to_token_rewards,
)
from rlpost.config import OptimConfig
from rlpost.params import LossChoice, PPOClipParams, variants
from rlpost.rollout.engines.hf import HFEngine
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.train.actor import ActorSettings, PolicyTrainer
from rlpost.train.batch import collate


def _batch(model, tok):
    ids = [
        tok(t, add_special_tokens=False)["input_ids"] for t in ["12+7=", "3-9=", "20+11=", "5+5="]
    ]
    cs = HFEngine(model, tok, seed=0).generate(ids, SamplingParams(max_tokens=5), n=4)
    scores = [float(i % 4 < 2) for i in range(len(cs))]
    b = collate(cs, scores, tok.pad_token_id)
    b.advantages, _ = get_advantage_estimator("grpo")(
        scores_to_token_rewards(b.scores, b.response_mask), b.response_mask, b.group
    )
    return b


def _trainer(model, **kw):
    s = ActorSettings(
        optim=OptimConfig(lr=1e-3), mini_batch_size=16, micro_batch_size=kw.pop("micro", 16), **kw
    )
    return PolicyTrainer(model, PPOClipParams(), s, kl_estimator=get_kl_estimator("k3"))


def test_positive_advantage_raises_logprob(tiny):
    model, tok = tiny
    m = copy.deepcopy(model)
    b = _batch(m, tok)
    tr = _trainer(m)
    b.old_logprobs = tr.old_logprobs(b)
    before = (b.old_logprobs * b.response_mask).sum(1)
    tr.update(b)
    after = (tr.old_logprobs(b) * b.response_mask).sum(1)
    pos, neg = b.scores > 0.5, b.scores < 0.5
    assert (after - before)[pos].mean() > 0 > (after - before)[neg].mean()


def test_on_policy_step_fills_old_logprobs_and_matches_explicit(tiny):
    model, tok = tiny
    a, c = copy.deepcopy(model), copy.deepcopy(model)
    b1 = _batch(a, tok)
    b2 = copy.deepcopy(b1)
    ta, tc = _trainer(a, micro=5), _trainer(c, micro=5)
    assert ta.single_update(len(b1))
    b1.old_logprobs = ta.old_logprobs(b1)
    explicit = b1.old_logprobs.clone()
    s1 = ta.update(b1).stats
    b2.old_logprobs = None
    given = copy.deepcopy(b2)
    done = tc.update(b2)
    assert b2.old_logprobs is None  # returned, not written into the caller's batch
    for name in ("responses", "response_mask", "advantages", "rollout_logprobs"):
        assert torch.equal(getattr(b2, name), getattr(given, name)), name
    assert torch.allclose(
        done.old_logprobs * b2.response_mask, explicit * b2.response_mask, atol=1e-5
    )
    assert s1["loss"] == pytest.approx(done.stats["loss"], abs=1e-6)
    for p, q in zip(a.parameters(), c.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)


def test_micro_batch_split_gives_the_same_update(tiny):
    model, tok = tiny
    a, c = copy.deepcopy(model), copy.deepcopy(model)
    b = _batch(a, tok)
    ta, tc = _trainer(a, micro=16), _trainer(c, micro=3)
    b.old_logprobs = ta.old_logprobs(b)
    ta.update(copy.deepcopy(b))
    tc.update(copy.deepcopy(b))
    for p, q in zip(a.parameters(), c.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-5)


def test_nan_loss_skips_the_update(tiny):
    model, tok = tiny
    m = copy.deepcopy(model)
    b = _batch(m, tok)
    tr = _trainer(m)
    b.old_logprobs = tr.old_logprobs(b)
    b.advantages = torch.full_like(b.advantages, float("nan"))
    before = [p.clone() for p in m.parameters()]
    stats = tr.update(b).stats
    assert stats["skipped"] == 1.0 and tr.skipped_updates == 1
    for p, q in zip(before, m.parameters(), strict=True):
        assert torch.equal(p, q)


def test_multi_step_update_refuses_missing_old_logprobs(tiny):
    model, tok = tiny
    m = copy.deepcopy(model)
    b = _batch(m, tok)
    tr = PolicyTrainer(m, PPOClipParams(), ActorSettings(mini_batch_size=8, micro_batch_size=8))
    with pytest.raises(ValueError, match="old_logprobs"):
        tr.update(b)


def test_warmup_and_lr_scaling(tiny):
    model, _tok = tiny
    tr = PolicyTrainer(
        copy.deepcopy(model),
        PPOClipParams(),
        ActorSettings(optim=OptimConfig(lr=1.0, warmup_steps=3)),
    )
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(0.25)
    assert tr.scale_lr(0.5) == pytest.approx(0.5)
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(0.125)


def test_rollout_correction_weights_the_loss_and_masks_tokens(tiny):
    from rlpost.params import MaskCorrection, TISCorrection

    model, tok = tiny
    b = _batch(copy.deepcopy(model), tok)

    def update(variant, rollout_shift):
        m = copy.deepcopy(model)
        s = ActorSettings(
            optim=OptimConfig(lr=1e-3), mini_batch_size=16, micro_batch_size=16, correction=variant
        )
        tr = PolicyTrainer(m, PPOClipParams(), s)
        batch = copy.deepcopy(b)
        batch.old_logprobs = tr.old_logprobs(batch)
        batch.rollout_logprobs = batch.old_logprobs + rollout_shift
        return tr.update(batch).stats, m

    plain, m_plain = update(None, 0.0)
    # engine and trainer agree: every weight is 1 and the update is the plain one
    same, m_same = update(TISCorrection(), 0.0)
    assert same["is_weight_mean"] == pytest.approx(1.0) and same["loss"] == pytest.approx(
        plain["loss"]
    )
    for p, q in zip(m_plain.parameters(), m_same.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    # the engine gave every token a ratio of e^3 > high: the IcePop mask drops them all
    masked, m_masked = update(MaskCorrection(low=0.5, high=5.0), -3.0)
    assert masked["is_masked_frac"] == pytest.approx(1.0) and masked["pg_loss"] == 0.0
    for p, q in zip(model.parameters(), m_masked.parameters(), strict=True):
        torch.testing.assert_close(p, q)  # no gradient, no move (AdamW without weight decay)


def _selector_trainer(model, name, micro, **kw):
    s = ActorSettings(optim=OptimConfig(lr=1e-3), mini_batch_size=16, micro_batch_size=micro)
    return PolicyTrainer(model, variants(LossChoice)[name](**kw.pop("params", {})), s, **kw)


@pytest.mark.parametrize("name", ["kl_cov", "clip_cov"])
def test_token_selection_is_made_per_mini_batch_so_micro_splits_agree(tiny, name):
    model, tok = tiny
    a, c = copy.deepcopy(model), copy.deepcopy(model)
    b = _batch(a, tok)
    params = (
        {"kl_cov_ratio": 0.1} if name == "kl_cov" else {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.0}
    )
    ta, tc = (
        _selector_trainer(a, name, 16, params=params),
        _selector_trainer(c, name, 3, params=params),
    )
    b.old_logprobs = ta.old_logprobs(b)
    sa, sc = ta.update(copy.deepcopy(b)).stats, tc.update(copy.deepcopy(b)).stats
    assert sa["clip_frac"] > 0 and sa["clip_frac"] == pytest.approx(sc["clip_frac"], abs=1e-6)
    for p, q in zip(a.parameters(), c.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-5)


def test_token_selector_needs_old_logprobs_up_front(tiny):
    model, tok = tiny
    m = copy.deepcopy(model)
    b = _batch(m, tok)
    tr = _selector_trainer(m, "kl_cov", 5)
    assert tr.single_update(len(b))
    b.old_logprobs = None  # the step plan runs a pass for a selecting loss
    with pytest.raises(ValueError, match="token selector"):
        tr.update(b)


def test_nll_term_on_rewarded_samples(tiny):
    model, tok = tiny
    a, c, d = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    b = _batch(a, tok)
    b.advantages = torch.zeros_like(b.advantages)  # only the NLL term moves the policy
    ta, tc = _trainer(a, nll_coef=1.0), _trainer(c, nll_coef=1.0, micro=3)
    b.old_logprobs = ta.old_logprobs(b)
    rewarded = (b.scores > 0)[:, None] & (b.response_mask > 0)
    nll = -(b.old_logprobs * rewarded).sum() / rewarded.sum()
    stats = ta.update(copy.deepcopy(b)).stats
    tc.update(copy.deepcopy(b))
    assert stats["nll_loss"] == pytest.approx(float(nll), rel=1e-4)
    for p, q in zip(a.parameters(), c.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-5)  # micro-batch invariant
    after = ta.old_logprobs(b)
    pos, neg = b.scores > 0, b.scores <= 0
    gain = ((after - b.old_logprobs) * b.response_mask).sum(1)
    assert gain[pos].mean() > 0  # rewarded answers became more likely
    off = _trainer(d)
    assert "nll_loss" not in off.update(copy.deepcopy(b)).stats
    assert gain[neg].abs().mean() < gain[pos].mean()


def test_chunked_head_update_equals_the_full_logits_update(tiny):
    """The loss pass through the chunked LM head (entropy bonus on) moves the weights as
    the full-logits pass does, and the scoring pass gives the same logprobs."""
    model, tok = tiny
    a, c = copy.deepcopy(model), copy.deepcopy(model)
    b1 = _batch(a, tok)
    b2 = copy.deepcopy(b1)
    ta = _trainer(a, micro=5, entropy_coef=0.01, logits_chunk=3)
    tc = _trainer(c, micro=5, entropy_coef=0.01, logits_chunk=-1)
    b1.old_logprobs, b2.old_logprobs = ta.old_logprobs(b1), tc.old_logprobs(b2)
    mask = b1.response_mask
    assert torch.allclose(b1.old_logprobs * mask, b2.old_logprobs * mask, atol=1e-5)
    s1, s2 = ta.update(b1).stats, tc.update(b2).stats
    assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-5)
    assert s1["entropy"] == pytest.approx(s2["entropy"], abs=1e-5)
    pairs = zip(a.parameters(), model.parameters(), strict=True)
    moved = max((p - q).abs().max() for p, q in pairs)
    assert moved > 1e-4
    for p, q in zip(a.parameters(), c.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-5)
