"""A loss aggregation from outside the package: the mean over rows of each row's token mean,
over the mini-batch's rows (``agg.num_seqs``), so micro-batches add up to the mini-batch."""


def row_mean(loss_mat, mask, agg):
    per_row = (loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_row.sum() / (agg.num_seqs or mask.shape[0])
