"""A reward from outside the package: 1 + bonus when the completion holds the answer."""


def exact(sample, bonus=0.0):
    """1 + bonus when the completion holds the reference answer, else 0."""
    return 1.0 + bonus if str(sample.answer) in sample.completion else 0.0
