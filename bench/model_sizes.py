"""The two model sizes the speed benches compare at (tiny Llama-family shapes, built from a
config by ``rlpost.models.tiny``): the default job's tiny model and one of about 25M
parameters, where matmuls rather than Python overhead set the pace."""

SIZES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    ),
    "25M": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
    ),
}

# A bench run measures the loop, not its side work: no periodic evaluation or checkpoints,
# no progress bar or plot, one sample per held-out problem.
QUIET_RUN = [
    "eval.samples=1",
    "eval.every=0",
    "checkpoint.every=0",
    "observe.progress=false",
    "observe.plot=false",
]
