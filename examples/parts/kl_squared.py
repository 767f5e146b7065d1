"""A KL estimator from outside the package: half the squared log-ratio (k2)."""


def half_square(logprobs, ref_logprobs):
    return 0.5 * (logprobs - ref_logprobs.detach()) ** 2
