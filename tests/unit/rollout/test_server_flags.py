"""``rlpost serve``'s flags: a limit set alone is never refused for another's default."""

from rlpost.rollout.serve.server import _checked, build_parser


def checked(*argv: str):
    args = build_parser().parse_args(list(argv))
    return _checked(args), args


def test_max_pending_alone_lowers_the_per_request_limit_with_it():
    problem, args = checked("--max-pending", "1")
    assert problem is None and args.max_request_sequences == 1
    problem, args = checked()
    assert problem is None and args.max_request_sequences == 1024


def test_two_limits_set_against_each_other_are_refused_in_one_line():
    problem, _ = checked("--max-pending", "1", "--max-request-sequences", "2")
    assert problem == "--max-request-sequences must be <= --max-pending"
    problem, _ = checked("--max-request-sequences", "0")
    assert problem == "--max-request-sequences must be >= 1"


def test_a_request_batch_below_one_is_refused_in_one_line():
    assert checked("--max-request-batch", "0")[0] == "--max-request-batch must be >= 1"
    problem, args = checked("--max-request-batch", "4")
    assert problem is None and args.max_request_batch == 4
