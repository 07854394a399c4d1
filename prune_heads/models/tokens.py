"""Text as the model's token ids, the way lm-evaluation-harness (HFLM) tokenises: no special tokens but BOS for the
families lm-eval gives one, and a context's trailing spaces moved to its continuation."""
from __future__ import annotations

from prune_heads.errors import UserError
from prune_heads.models.loading import LoadedModel


def encode(lm: LoadedModel, text: str) -> list[int]:
    """``text`` as the model's token ids (BOS first for the families lm-eval gives one); a tokenizer that produces
    an id the embedding has no row for is refused before any pass."""
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    if lm.arch.add_bos_for_eval and lm.tokenizer.bos_token_id is not None:
        ids = [lm.tokenizer.bos_token_id] + ids
    rows = lm.model.get_input_embeddings().num_embeddings
    if ids and max(ids) >= rows:
        raise UserError(f"the tokenizer of {lm.source.spec} produces token id {max(ids)} (its vocabulary has "
                        f"{len(lm.tokenizer):,} tokens), but the model's embedding has {rows:,} rows: the tokenizer "
                        "does not belong to these weights; pass the model's own tokenizer files")
    return ids


def encode_pair(lm: LoadedModel, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``_encode_pair``: trailing spaces of the context belong to the continuation."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    context_enc = encode(lm, context)
    return context_enc, encode(lm, context + continuation)[len(context_enc):]
