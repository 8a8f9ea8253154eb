"""The manifest's `init:` section: the weights a run starts from instead of its seeded init (torch-free).

    init:
      hf: /models/Llama-3.2-1B          # a local Hugging Face model directory (config.json, safetensors)
      # checkpoint: runs/base/ckpt/step-00001000   # or a committed mantra step directory (weights only)
      allow_pickle: false               # pytorch_model.bin only when true, read with weights_only=True

Either source starts the run at step 0 with fresh optimizer state. Once the run has a checkpoint of its own
(an interrupted run resuming), `init` is not read again. The rules in trainer/manifest/rules/init.py check
the section against config.json and the files; trainer/init/ reads the weights.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from trainer.manifest.sections import Section


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
