"""How a checkpoint spells the language model's tensor names: the one mapping from the names the model asks for
(``CausalLM.checkpoint_plan``: DeepSeek-V3 / Qwen3-MoE HF names, ``model.layers.3.mlp.experts.7.up_proj.weight``) to
the names stored in the files.

Spellings accepted (docs/quantization.md, "Checkpoint layouts"):

- plain (``deepseek_v3``, ``kimi_k2``, ``qwen3_moe``): ``model.…``, ``lm_head.weight``;
- ``kimi_k25`` as Moonshot publishes Kimi K2.5 / K2.6: ``language_model.model.layers.…``,
  ``language_model.lm_head.weight``;
- ``kimi_k25`` as HF transformers 5.23's ``save_pretrained`` writes ``Kimi_K25ForConditionalGeneration``:
  ``language_model.model.blocks.…`` (its vision ``blocks → layers`` rename, reversed on save, also renames the
  language model's layers), ``language_model.lm_head.weight``.

Tensors of the image path (``vision_tower.*``, ``mm_projector.*``, and HF's ``model.vision_tower.*``,
``model.mm_projector.*``) are not the language model's: :func:`image_tensors` counts them so the start-up log can
say they are left unread.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

IMAGE_PREFIXES = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")
LANGUAGE_MODEL = "language_model."


@dataclass(frozen=True)
class CheckpointNames:
    """A checkpoint's spelling: ``prefix`` before every language-model name, ``layers`` the word for the decoder
    layer list (``layers``, or ``blocks`` in HF's ``save_pretrained`` of ``kimi_k25``)."""

    prefix: str = ""
    layers: str = "layers"

    def stored(self, name: str) -> str:
        """The stored name of the model's tensor ``name``: ``model.layers.1.…`` → ``language_model.model.blocks.1.…``
        in HF's spelling."""
        if self.layers != "layers" and name.startswith("model.layers."):
            name = f"model.{self.layers}." + name[len("model.layers."):]
        return self.prefix + name

    @staticmethod
    def of(weight_prefix: str, stored: Iterable[str]) -> CheckpointNames:
        """The spelling of a checkpoint whose config puts the language model under ``weight_prefix`` (``""`` or
        ``language_model.``; ``ModelConfig.weight_prefix``) and whose files hold the tensor names ``stored``."""
        if not weight_prefix:
            return CheckpointNames()
        blocks = f"{weight_prefix}model.blocks."
        layers = f"{weight_prefix}model.layers."
        names = list(stored)
        hf_saved = any(n.startswith(blocks) for n in names) and not any(n.startswith(layers) for n in names)
        return CheckpointNames(weight_prefix, "blocks" if hf_saved else "layers")


def image_tensors(stored: Iterable[str]) -> list[str]:
    """The stored names that belong to the vision tower or the projector (never read while images are not
    served)."""
    return [n for n in stored if n.startswith(IMAGE_PREFIXES)]
