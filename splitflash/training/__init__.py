"""Training a DFlash drafter for a target (DFLASH.md's recipe, at laptop-to-one-GPU scale).

data.py      prompts built from documents and code already on this machine (no downloads)
dense.py     the target without a paged cache: batched greedy generation, hidden features
responses.py the target regenerates every response, cached on disk as token ids
recipe.py    the default drafter shape and target feature layers for a target
blocks.py    the training forward: many anchors per sequence in one masked pass, the loss
trainer.py   AdamW + cosine, bf16 autocast, checkpoints and resume, `save_dflash` output
"""
