"""The manifest's `init:` section: the weights a run starts from instead of its seeded init (torch-free).

    init:
      hf: /models/Llama-3.2-1B          # a local Hugging Face model directory (config.json, safetensors)
      # checkpoint: runs/base/ckpt/step-00001000   # or a committed mantra step directory (weights only)
      allow_pickle: false               # pytorch_model.bin only when true, read with weights_only=True

With init.hf, a text or chat run whose data section names no tokenizer uses the directory's: data.tokenizer
defaults to init.hf when it holds a tokenizer.json (default_tokenizer, as the manifest is read, so the
resolved manifest in the run directory names it), and the data rules check that its ids fit model.vocab.

Either source starts the run at step 0 with fresh optimizer state. Once the run has a checkpoint of its own
(an interrupted run resuming), `init` is not read again. The rules in trainer/manifest/rules/init.py check
the section against config.json and the files; trainer/init/ reads the weights.
"""

from __future__ import annotations

import os

from pydantic import Field, model_validator

from trainer.manifest.sections import Section
from trainer.manifest.source import SourceTree

TOKENIZER_SOURCES = ("text", "chat")  # the data sources that tokenize, so read data.tokenizer


class InitSection(Section):
    hf: str | None = Field(None, description="a local Hugging Face model directory to start from (config.json, "
                           "model.safetensors or its sharded index); model: must agree with its config.json")
    checkpoint: str | None = Field(None, description="a committed mantra step directory to start from: its "
                                   "weights only, at step 0 with fresh optimizer state")
    allow_pickle: bool = Field(False, description="init.hf: accept pytorch_model.bin (a pickle), read with "
                               "torch.load(weights_only=True)")

    @model_validator(mode="after")
    def _one_source(self) -> InitSection:
        if self.hf and self.checkpoint:
            raise ValueError("init.hf and init.checkpoint are both set; start from one of them")
        return self


def default_tokenizer(tree: SourceTree) -> None:
    """data.tokenizer: init.hf, in the tree as read, when init.hf holds a tokenizer.json, the source is text or
    chat and the data section names no tokenizer (module docstring). A problem with that tokenizer is then
    reported at init.hf's line, where its value was written."""
    init, data = tree.data.get("init"), tree.data.get("data")
    hf = init.get("hf") if isinstance(init, dict) else None
    if not isinstance(hf, str) or not hf or not isinstance(data, dict) or "tokenizer" in data:
        return
    if data.get("source") not in TOKENIZER_SOURCES or not os.path.isfile(os.path.join(hf, "tokenizer.json")):
        return
    data["tokenizer"] = hf
    if ("init", "hf") in tree.value_locations:
        tree.value_locations[("data", "tokenizer")] = tree.value_locations[("init", "hf")]
