"""Rules of the data section: what it says (data_source, also for plan and dry-run), the files it names
(data_files: validate and run only), and the layouts a document mask cannot reach yet."""

from __future__ import annotations

from collections.abc import Iterator

from trainer.manifest.choices import DataSource
from trainer.manifest.rules.finding import Finding
from trainer.manifest.schema import Manifest


def _about_a_file(data, field: str) -> bool:
    """Whether a data.`field` problem from check_data comes from looking at a file: a path that is set
    (not a missing one), a tokenizer other than 'byte' (not the byte-vocab rule), the .bin's dtype,
    a blend's file (not the blend as a whole), the validation file (unless the source is synthetic)."""
    if field == "path":
        return bool(data.path)
    if field.startswith("sources."):
        return True
    if field == "valid":
        return DataSource(data.source) is not DataSource.synthetic
    if field == "chat_template":
        return bool(data.chat_template) or data.tokenizer != "byte"
    return field == "dtype" or (field == "tokenizer" and data.tokenizer != "byte")


def data_source(m: Manifest) -> Iterator[Finding]:
    """What the data section says, without its files (plan and dry-run read none)."""
    from trainer.data.checks import check_data  # numpy: imported when a manifest is checked, not with the package

    for field, message in check_data(m.data, seq_len=m.model.seq_len, vocab=m.model.vocab):
        if not _about_a_file(m.data, field):
            yield Finding(f"data.{field}", message)


def data_files(m: Manifest) -> Iterator[Finding]:
    """The data files themselves: there, readable, long enough (validate and run, which reads them)."""
    from trainer.data.checks import check_data

    for field, message in check_data(m.data, seq_len=m.model.seq_len, vocab=m.model.vocab):
        if _about_a_file(m.data, field):
            yield Finding(f"data.{field}", message)


def document_mask_layouts(m: Manifest) -> Iterator[Finding]:
    """data.document_mask reaches attention through the model's forward: not through a pipeline stage's
    or a context-parallel core's yet."""
    yield from document_mask_of(m.data.document_mask, m.parallel.cp, m.parallel.pp)


def document_mask_of(document_mask: bool, cp: int, pp: int) -> Iterator[Finding]:
    """document_mask_layouts on plain values (`mantra plan --search` calls it on its candidates' values)."""
    if document_mask and cp > 1:
        yield Finding("data.document_mask", "not supported yet: document masking with context parallel (the ring "
                      "and Ulysses cores take no mask); set document_mask: false or cp: 1")
    if document_mask and pp > 1:
        yield Finding("data.document_mask", "not supported yet: document masking with pipeline parallel (the "
                      "stages pass no mask along); set document_mask: false or pp: 1")


def chat_layouts(m: Manifest) -> Iterator[Finding]:
    """data.source chat scales each microbatch's loss (trainer/data/chat/batches.py) in train_step and in the
    pipeline's last stage (trainer/parallel/pipeline/executor.py): not across a context-parallel split yet."""
    if DataSource(m.data.source) is not DataSource.chat:
        return
    if m.parallel.cp > 1:
        yield Finding("data.source", "not supported yet: chat data with context parallel (each cp rank would "
                      "count its own loss tokens); set parallel.cp: 1")
