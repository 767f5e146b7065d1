"""The part of ``rollout.engine=vllm`` that runs inside vLLM's workers.

vLLM mixes :class:`WeightLoader` into each worker (``worker_extension_cls``), so
``collective_rpc("rlpost_load_weights", ...)`` calls it by name: no pickled function crosses
to the engine core and vLLM's insecure serialisation stays off. ``collective_rpc`` arguments
travel as msgpack (a tensor arrives as a list), so the tensors travel as a safetensors file on
shared memory, loaded without unpickling through vLLM's in-place reload (the model's own
``load_weights`` and the backend's post-load processing). Importing this module must stay
cheap and import nothing of vLLM: the workers import it at start-up.
"""

from __future__ import annotations

from safetensors import safe_open


class WeightLoader:
    """Worker extension: load a weight file into this worker's model, with a version."""

    def rlpost_load_weights(self, path: str, version: int | str) -> list[int]:
        """Copy the tensors of the safetensors file ``path`` into the model; returns
        ``[version, tensors loaded]`` so the caller can check every worker took it.

        ``version`` may arrive as a string: ``vllm serve``'s ``/collective_rpc`` route
        passes only strings, and a list is what it returns as JSON unchanged."""
        version = int(version)
        dtype = next(self.model_runner.get_model().parameters()).dtype
        with safe_open(path, framework="pt") as f:
            # The trainer's dtype (fp32 master weights) becomes the serving dtype here.
            weights = [(name, f.get_tensor(name).to(dtype)) for name in f.keys()]
        # vLLM's in-place reload, not the model's bare load_weights: backends that repack
        # weights after loading (the CPU one does) leave the checkpoint-format parameters
        # empty; the reload restores them, loads, and repacks into the same kernel tensors.
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        _reprocess_tied(self.model_runner.get_model())
        return [version, len(weights)]


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
