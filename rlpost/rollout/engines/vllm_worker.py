"""The part of ``rollout.engine=vllm`` that runs inside vLLM's workers.

vLLM mixes :class:`WeightLoader` into each worker (``worker_extension_cls``), so
``collective_rpc("rlpost_load_weights", ...)`` calls it by name: no pickled function crosses
to the engine core and vLLM's insecure serialisation stays off. ``collective_rpc`` arguments
travel as msgpack (a tensor arrives as a list), so the tensors travel as a safetensors file (on
shared memory, or fetched over HTTP from the trainer), loaded without unpickling through vLLM's
in-place reload (the model's own ``load_weights`` and the backend's post-load processing).
Importing this module must stay cheap, nothing of vLLM: the workers import it at start-up.
"""

from __future__ import annotations

import urllib.request

from safetensors import safe_open
from safetensors.torch import load as load_bytes

PULL_TIMEOUT_S = 300.0


class WeightLoader:
    """Worker extension: load a weight file into this worker's model, with a version."""

    def rlpost_load_weights(self, path: str, version: int | str) -> list[int]:
        """Copy the tensors of the safetensors file ``path`` (or an ``http://`` URL serving
        one) into the model; returns ``[version, tensors loaded]`` so the caller can check
        every worker took it.

        ``version`` may arrive as a string: ``vllm serve``'s ``/collective_rpc`` route
        passes only strings, and a list is what it returns as JSON unchanged."""
        version = int(version)
        dtype = next(self.model_runner.get_model().parameters()).dtype
        # The trainer's dtype (fp32 master weights) becomes the serving dtype here.
        weights = [(name, t.to(dtype)) for name, t in read_weights(path)]
        # vLLM's in-place reload, not the model's bare load_weights: backends that repack
        # weights after loading (the CPU one does) leave the checkpoint-format parameters
        # empty; the reload restores them, loads, and repacks into the same kernel tensors.
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        _reprocess_tied(self.model_runner.get_model())
        return [version, len(weights)]


def read_weights(source: str) -> list:
    """The ``(name, tensor)`` pairs of a safetensors file, from a path or an HTTP URL."""
    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source, timeout=PULL_TIMEOUT_S) as r:
            return list(load_bytes(r.read()).items())
    with safe_open(source, framework="pt") as f:
        return [(name, f.get_tensor(name)) for name in f.keys()]


def _reprocess_tied(model) -> None:
    """Run the post-load processing again on every layer whose weight another layer shares.

    The reload processes a tied weight once, for one of its layers (the input embedding);
    an output head tied to it keeps what its own processing built from the old weight (on
    CPU a packed GEMM operand), and would score tokens with the old embedding. Where the
    processing builds nothing (GPU), running it again changes nothing.
    """
    holders: dict[int, list] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and getattr(module, "quant_method", None) is not None:
            holders.setdefault(id(weight), []).append(module)
    for modules in holders.values():
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)
