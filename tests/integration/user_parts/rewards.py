"""Rewards from outside the package: one that works, and each mistake a user makes."""


def exact(sample, bonus=0.0):
    """1 + bonus when the completion holds the reference answer, else 0."""
    return 1.0 + bonus if str(sample.answer) in sample.completion else 0.0


def wrong_signature():
    return 1.0


def says_yes(sample):
    return "yes"


def raises(sample):
    raise KeyError("score")


def nan(sample):
    return float("nan")


def never_applies(sample):
    return None


def fails_later(sample):
    """Fine on the data's reference answers, raises on a sampled completion."""
    if str(sample.answer) != sample.completion:
        raise ValueError("cannot parse the completion")
    return 1.0
