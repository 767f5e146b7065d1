"""An engine from outside the package: the ``hf`` engine, counting the prompts it samples.

It declares the ``hf`` engine's traits (it serves the policy's own memory in batches), so
the run plans for it as it would for ``hf``.
"""

from rlpost.registry import part
from rlpost.resolved import ENGINES

SAMPLED = []


@part(whole_batches=True, shares_storage=True)
def counting(cfg, facts, model, tokenizer):
    engine = ENGINES.get("hf")(cfg, facts, model, tokenizer)
    generate = engine.generate

    def counted(prompts, *args, **kwargs):
        SAMPLED.append(len(prompts))
        return generate(prompts, *args, **kwargs)

    engine.generate = counted
    return engine
