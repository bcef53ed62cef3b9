"""What the workloads share: pre-trained models and their vocabulary, loaded offline.

`plm` is a plain post-LN BERT that loads Hugging Face-named weights; `xlmr_e5` (multilingual-e5-small,
XLM-R vocabulary) and `minilm` (all-MiniLM-L6-v2) load the two shipped checkpoints into it; `vocab` cuts
a pre-trained vocabulary down to the ids a corpus uses. ABNet-Cloud and ELECTRA-Cloud both build on
them, and neither imports the other (an import contract in pyproject.toml holds it).
"""
