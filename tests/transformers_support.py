"""Hugging Face transformers, as the tests load it: ``from_pretrained``'s arguments for its own
tensor-parallel plan."""

from __future__ import annotations


def tp_auto() -> dict:
    """``from_pretrained``'s arguments for ``tp_plan="auto"``: ``distributed_config`` where
    transformers has it (passing ``tp_plan`` directly is deprecated in transformers 5)."""
    import transformers

    if hasattr(transformers, "DistributedConfig"):
        return {"distributed_config": transformers.DistributedConfig(tp_plan="auto")}
    return {"tp_plan": "auto"}
